"""run_on_ray: the claiming worker drives a job's ranks on the Ray cluster and relays rank 0's callbacks.

Order: reserve the gang (all nodes' GPUs at once, with an asynchronous job's
sampler's own GPU, or GangUnavailable), start one actor per rank in it (and
the sampler actor, whose handle rank 0 gets), read where they landed (layout.py), hand each its
files and environment, then answer rank 0's requests as the torchrun
launcher does (worker/torchrun/launch.py, same dispatch), writing each
checkpoint rank 0 sends into run_dir before the callbacks upload it (fenced).
However it ends, every actor is killed and the placement group removed.

A rank whose node left the cluster raises NodeLost (the job waits it out
using no attempt); a rank error of a known kind is raised as that kind.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from service.job_spec.spec import JobSpec
from service.settings import Settings
from worker.torchrun.launch import KNOWN_ERRORS, RankFailed, scoring_wire, dispatch_rank_message
from worker.ray_driver import cluster
from worker.ray_driver.errors import NodeLost
from worker.ray_driver.files import pack, unpack_dir
from worker.ray_driver.layout import rank_envs
from worker.ray_driver.rank_actor import RUN, QueueChannel, RankActor
from worker.ray_driver.sampler_actor import SamplerActor
from worker.rewards.engine import ScoringContext

log = logging.getLogger(__name__)
NODE_DEATH_NOTICE_S = 30.0


def run_on_ray(spec: JobSpec, run_dir: Path, callbacks, *, settings: Settings, scoring: ScoringContext | None = None,
               resume: bool = True, stop_grace_s: float = 60.0, startup_timeout_s: float = 600.0, job_name: str = "job",
               rank_actor: type = RankActor):
    """Train the job on the Ray cluster at settings.ray_address; returns its TrainResult (as run_training).
    `rank_actor`: RankActor or a subclass (bench/ray_step.py times the collectives in one)."""
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from worker.trainer.callbacks import TrainResult

    run_dir = Path(run_dir)
    res = spec.resources
    cluster.connect(settings.ray_address)
    gpus = cluster.uses_gpus()
    asynchronous = spec.rollout.max_staleness > 0  # the sampler runs as an actor of its own (sampler_actor.py)
    _event(callbacks, f"Waiting for {res.nodes} Ray node(s) x {res.gpus} {'GPU' if gpus else 'CPU'}(s)"
           + (" and the sampler's" if asynchronous else ""))
    groups = cluster.reserve(res.nodes, res.gpus, gpus, settings.ray_gang_timeout_s, name=f"cispo-{job_name}",
                             should_stop=callbacks.should_stop, sampler=asynchronous)
    if groups is None:  # stopped while waiting for its nodes: nothing ran, the job keeps its newest checkpoint
        return TrainResult(0, True, None, None, None)
    group = groups[0]
    actors, queues, sampler = [], [], None
    try:
        remote = ray.remote(rank_actor)
        for node in range(res.nodes):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=node)
            actors += [remote.options(num_cpus=1, num_gpus=1 if gpus else 0, scheduling_strategy=strategy,
                                      max_restarts=0).remote() for _ in range(res.gpus)]
        sampler = _start_sampler(groups[1], gpus) if asynchronous else None
        places = ray.get([a.where.remote() for a in actors], timeout=startup_timeout_s)
        port = ray.get(actors[0].free_port.remote(), timeout=startup_timeout_s)
        envs = rank_envs(places, port)
        _event(callbacks, f"Started {len(actors)} rank(s) on {len({p['node'] for p in places})} Ray node(s)")
        watched = places  # a node that held one of them lost: NodeLost
        if sampler is not None:
            watched = places + [{**ray.get(sampler.where.remote(), timeout=startup_timeout_s), "role": "the sampler"}]
            _event(callbacks, f"Started the sampler actor on Ray node {watched[-1]['node'][:12]}")
        # On rank 0's node: they live and die with it (and take no CPU from the gang).
        beside_rank0 = {"num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0)}
        queues = [Queue(actor_options=beside_rank0), Queue(actor_options=beside_rank0)]
        channel = QueueChannel(*queues)
        files = ray.put(pack(_shipped(spec, run_dir, resume)))
        shipped = _relative(spec).model_dump_json()
        runs = [a.run.remote(shipped, files, env, resume, scoring_wire(scoring) if i == 0 else None,
                             channel if i == 0 else None, sampler if i == 0 else None)
                for i, (a, env) in enumerate(zip(actors, envs))]
        result = _serve(runs, watched, queues, callbacks, run_dir, stop_grace_s)
        last = run_dir / "checkpoints" / result["last_checkpoint"] if result["last_checkpoint"] else None
        return TrainResult(result["steps_done"], result["stopped"], last, result["first_eval"], result["last_eval"])
    finally:
        cluster.release(groups, actors, [q.actor for q in queues] + ([sampler] if sampler is not None else []))


def _start_sampler(group, gpus: bool):
    """The sampler actor in its own placement group: one GPU (or one CPU), its child decoding on that CPU."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Threaded: rank 0's scoring thread blocks in receive while its trainer thread publishes versions.
    return ray.remote(SamplerActor).options(
        num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=0, max_concurrency=4,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)).remote(threads=1)


def _shipped(spec: JobSpec, run_dir: Path, resume: bool) -> dict[str, Path]:
    """What the ranks need from this machine: the dataset, a warm start, the checkpoint to resume from."""
    sources = {"data/train.jsonl": Path(spec.data.train_file)}
    if spec.data.validation_file:
        sources["data/validation.jsonl"] = Path(spec.data.validation_file)
    if spec.init_from:
        sources["start"] = Path(spec.init_from)
    if resume:
        for local in sorted((run_dir / "checkpoints").glob("*")):
            if local.is_dir():
                sources[f"{RUN}/checkpoints/{local.name}"] = local
    return sources


def _relative(spec: JobSpec) -> JobSpec:
    """The spec naming the shipped files relative to a rank's root (rank_actor.localize makes them paths)."""
    data = {"train_file": "data/train.jsonl"}
    if spec.data.validation_file:
        data["validation_file"] = "data/validation.jsonl"
    return spec.model_copy(update={"data": spec.data.model_copy(update=data),
                                   **({"init_from": "start"} if spec.init_from else {})})


def _serve(runs: list, places: list[dict], queues: list, callbacks, run_dir: Path, stop_grace_s: float) -> dict:
    """Answer rank 0's requests until it returns; raise what a rank reports, NodeLost, or RankFailed."""
    import ray

    try:
        return _relay(runs, queues, callbacks, run_dir, stop_grace_s)
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:  # a rank, a queue or a ref died
        raise _death(places, RankFailed(f"a rank's process died: {type(e).__name__}: {str(e)[:1000]}")) from None
    except RankFailed as e:  # a rank's own error: when a peer's node went, its collective fails first
        raise _death(places, e) from None


def _relay(runs: list, queues: list, callbacks, run_dir: Path, stop_grace_s: float) -> dict:
    import ray
    from ray.util.queue import Empty

    requests, answers = queues
    stop_since = None
    while True:
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for ref in done:
            outcome = ray.get(ref)
            if "error" in outcome:
                cls = KNOWN_ERRORS.get(outcome["error"])
                if cls:
                    raise cls(outcome["message"])
                raise RankFailed(f"rank {runs.index(ref)} failed: {outcome['error']}: {outcome['message']}\n"
                                 f"{outcome['trace']}")
            if ref is runs[0]:
                return outcome
        try:
            message = requests.get(timeout=0.5)
        except Empty:
            if callbacks.should_stop():  # cancel or a lost lease while a step runs: a grace period, then a kill
                stop_since = stop_since or time.monotonic()
                if time.monotonic() - stop_since > stop_grace_s:
                    raise RankFailed(f"the ranks did not stop within {stop_grace_s:.0f} s of a stop request; "
                                     "killed") from None
            continue
        kind = message.pop("kind")
        if kind == "checkpoint":
            path = unpack_dir(ray.get(message["files"][0]), run_dir / "checkpoints" / message["name"])
            callbacks.on_checkpoint(message["step"], path)
            answers.put({})
        else:
            answers.put(dispatch_rank_message(callbacks, kind, message))


def _death(places: list[dict], otherwise: Exception) -> Exception:
    """NodeLost when a node that held a rank left the cluster, else `otherwise`. The cluster marks a node dead
    some seconds after its processes go, so this waits for the verdict (a failure on live nodes ends that late)."""
    deadline = time.monotonic() + NODE_DEATH_NOTICE_S
    while True:
        lost = [p for p in places if p["node"] not in cluster.alive_nodes()]
        if lost:
            return NodeLost(f"the Ray node {lost[0]['node'][:12]} ({lost[0]['ip']}) that held "
                            f"{lost[0].get('role', 'a rank')} left the cluster")
        if time.monotonic() >= deadline:
            return otherwise
        time.sleep(1.0)


def _event(callbacks, message: str) -> None:
    event = getattr(callbacks, "event", None)
    if event is not None:
        event(message)
