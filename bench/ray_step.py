"""The cost of going multi-node: the toy job on a 2-node Ray cluster vs 1 node, on this machine's CPUs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ray_step.py [--steps 4] [--batch-size 4]

Starts a real ray.cluster_utils.Cluster (two CPUs per node), then runs the same
LoRA job through the service's Ray driver (worker/ray_driver/) three times: nodes 1
(one rank), nodes 2 (two ranks, gloo between "machines"), and nodes 2 with
rollout.max_staleness 1 (the sampler as a Ray actor of its own, sent each
version through the object store; its rollout wait is the trainer's time
waiting for a batch, 0 when sampling hides behind the update; its version send
is rank 0's ray.put of the adapter and the actor's enqueue, per step). Prints, per run,
the median step time (rank 0's wall time between consecutive steps, so the
first, with the model's load and sharding, is left out), the time rank 0
spent blocked in torch.distributed collectives in those steps (FSDP2's
all-gathers and reduce-scatters, the trainer's own gathers; synchronous calls
plus waits on asynchronous ones) and its share of the step, the checkpoint relay (rank 0 to
the driver through Ray: bytes and seconds per checkpoint), and the load
average beside the figures. Both nodes share this machine's cores, so the
2-node step measures the protocol's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.ray_driver.rank_actor import RankActor  # noqa: E402

# Every torch.distributed collective (FSDP2 calls all_gather_single / reduce_scatter_single in torch 2.13).
COLLECTIVE_WORDS = ("gather", "scatter", "reduce", "broadcast", "barrier", "all_to_all")
MARK = "bench-collectives "


class _TimedWork:
    """An asynchronous collective's handle whose wait() counts as time blocked in collectives."""

    def __init__(self, work, clock: dict):
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock["s"] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._work, name)


class _StepMarks:
    """Rank 0's channel, noting at each reported step the wall clock and the collectives' clock."""

    def __init__(self, channel, clock: dict):
        self.channel, self.clock, self.marks = channel, clock, []

    def request(self, kind, **fields):
        if kind == "step":
            self.marks.append((time.perf_counter(), self.clock["s"], self.clock["calls"], self.clock["publish_s"]))
        return self.channel.request(kind, **fields)


class TimedRankActor(RankActor):
    """A rank that times its torch.distributed collectives; rank 0 reports them per step as an event."""

    def _train(self, spec, resume, context, channel, sampler=None):
        import torch.distributed as dist

        from worker.ray_driver import sampler_actor

        clock = {"s": 0.0, "calls": 0, "publish_s": 0.0}
        publish = sampler_actor.RaySampler.publish

        def timed_publish(sampler, version, state):  # a version into the object store and the actor's inbox
            start = time.perf_counter()
            try:
                return publish(sampler, version, state)
            finally:
                clock["publish_s"] += time.perf_counter() - start

        sampler_actor.RaySampler.publish = timed_publish
        for name in [n for n in dir(dist) if any(w in n for w in COLLECTIVE_WORDS) and not n.startswith("_")]:
            original = getattr(dist, name)
            if callable(original) and not isinstance(original, type):
                setattr(dist, name, _timed(original, clock))
        marks = _StepMarks(channel, clock) if channel is not None else None
        result = super()._train(spec, resume, context, marks, sampler)
        if marks is not None:  # between consecutive steps: wall time, collectives, their number, version sends
            steps = [(b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3] - a[3]) for a, b in zip(marks.marks, marks.marks[1:])]
            channel.request("event", message=MARK + json.dumps(steps))
        return result


def _timed(function, clock: dict):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        clock["s"] += time.perf_counter() - start
        clock["calls"] += 1
        return _TimedWork(out, clock) if out is not None and hasattr(out, "wait") else out
    return timed


class Recorder:
    def __init__(self):
        self.steps, self.events, self.checkpoints = [], [], []
        self._since = None

    def on_step(self, step, metrics): self.steps.append(metrics)
    def on_eval(self, step, metrics): pass
    def on_checkpoint(self, step, path):
        self.checkpoints.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
    def event(self, message): self.events.append(message)
    def should_stop(self): return False


def run(cluster, toy_dir: Path, nodes: int, steps: int, batch_size: int, max_staleness: int = 0) -> dict:
    from service.job_spec.spec import JobSpec
    from service.settings import Settings
    from worker.ray_driver import driver
    from worker.ray_driver.files import unpack_dir
    from worker.toy.__main__ import toy_spec

    raw = toy_spec(toy_dir)
    raw["resources"] = {"nodes": nodes, "gpus": 1, "backend": "ray"}
    raw["rollout"] = {"max_staleness": max_staleness}
    raw["training"].update({"steps": steps, "batch_size": batch_size, "group_size": 4, "mini_batches": 1,
                            "micro_batch_size": 4, "eval_interval": 0, "checkpoint_interval": steps})
    spec = JobSpec.model_validate(raw)
    relay = []

    def timed_unpack(files, target):  # the driver's side of a checkpoint's relay: fetch (done) and write
        start = time.perf_counter()
        out = unpack_dir(files, target)
        relay.append(time.perf_counter() - start)
        return out

    calls = Recorder()
    driver.unpack_dir = timed_unpack
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        driver.run_on_ray(spec, Path(run_dir), calls, settings=Settings(ray_address=cluster.address),
                          rank_actor=TimedRankActor)
    wall = time.perf_counter() - start
    steps = next(json.loads(e[len(MARK):]) for e in calls.events if e.startswith(MARK))  # steps 2.. (warm)
    warm = calls.steps[1:]
    return {"nodes": nodes, "max_staleness": max_staleness, "wall_s": wall,
            "rollout_wait_s": statistics.median(m.get("rollout_wait_s", 0.0) for m in warm),
            "lag_max": max((m.get("policy_lag_max", 0.0) for m in calls.steps), default=0.0),
            "step_s": statistics.median(s[0] for s in steps),
            "collective_s": statistics.median(s[1] for s in steps), "calls": statistics.median(s[2] for s in steps),
            "publish_s": statistics.median(s[3] for s in steps),
            "checkpoint_bytes": calls.checkpoints[-1] if calls.checkpoints else 0,
            "relay_write_s": relay[-1] if relay else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--toy-dir", type=Path, default=Path(os.environ.get("CISPO_TEST_TOY_DIR", ".cispo/toy")))
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not (args.toy_dir / "spec.yaml").exists():
        from worker.toy.__main__ import prepare

        prepare(args.toy_dir)
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "object_store_memory": 80 * 1024**2}  # a rank each, and room for the sampler actor
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        rows = [run(cluster, args.toy_dir, nodes, args.steps, args.batch_size, staleness)
                for nodes, staleness in ((1, 0), (2, 0), (2, 1))]
    finally:
        ray.shutdown()
        cluster.shutdown()
    one = rows[0]
    print(f"toy LoRA job, {args.steps} steps, batch {args.batch_size} x group 4, one CPU per rank; "
          f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| nodes | max_staleness | step s (median) | vs 1 node | collectives s/step | share of step | calls/step "
          "| version send s/step | rollout wait s | lag max | checkpoint MB | relay write s | wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['nodes']} | {r['max_staleness']} | {r['step_s']:.2f} | {r['step_s'] / one['step_s']:.2f}x | "
              f"{r['collective_s']:.3f} | {r['collective_s'] / r['step_s']:.0%} | {r['calls']:.0f} | "
              f"{r['publish_s']:.3f} | {r['rollout_wait_s']:.2f} | {r['lag_max']:.0f} | "
              f"{r['checkpoint_bytes'] / 1e6:.2f} | {r['relay_write_s']:.3f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
