"""The asynchronous sampler of a Ray job (rollout.max_staleness > 0) as a Ray actor of its own.

The driver starts one SamplerActor in its own placement group bundle (one
GPU, or one CPU on a CPU cluster) beside the ranks' gang, and hands rank 0 its
handle; rank 0's RolloutPipeline then talks to it through RaySampler, which
has SamplerProcess's methods. The actor hosts exactly the single-node sampler:
a spawned child running worker/rollout/async_sampler.py (our decode loop, or
vLLM in the child's main thread with numbered LoRARequests), fed by the same
inbox in the same order:

    rank 0 ray.put(version tensors) -> actor.publish(v, ref) -> ("version", v, tensors)
    rank 0 actor.request(step, ...)                          -> ("request", step, ...)
    the child's ("batch", step, version, rollout, ...)       -> actor.receive -> rank 0's scoring thread

so the staleness bound is the one the child enforces (a request for step j waits
for version j - max_staleness). Rank 0 waits for each publish and request to be
enqueued before sending the next (the actor serves calls on several threads, so
only this keeps them in order); receive blocks on another of its threads.

The actor belongs to the driver's Ray job: the driver kills it with the ranks
however the job ends, and it dies with the driver. Its child stops when asked
(close), or on its own once the actor's process is gone.
"""

from __future__ import annotations

import os

from worker.rollout.async_sampler import SamplerDied, SamplerProcess

RECEIVE_TIMEOUT_S = 60.0  # how long rank 0 waits on one receive call beyond its own timeout


class SamplerActor:
    def __init__(self, threads: int):
        self.threads, self.sampler = threads, None

    def where(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def start(self, spec_json: str, version: int, state: dict, egress, secrets) -> int:
        """Start the sampler child with the policy after `version` steps; returns its pid."""
        from service.job_spec.spec import JobSpec

        self.sampler = SamplerProcess(JobSpec.model_validate_json(spec_json), version=version, state=state,
                                      threads=self.threads, egress=egress, secrets=secrets)
        return self.sampler.pid

    def pids(self) -> list[int]:
        """This actor's process and its sampler child's (tests check both are gone after a job)."""
        return [os.getpid(), *([self.sampler.pid] if self.sampler is not None else [])]

    def publish(self, version: int, state: dict) -> None:
        self.sampler.publish(version, state)

    def request(self, step: int, rows: list[dict], seeds: list[int], episode_seeds: list[int]) -> None:
        self.sampler.request(step, rows, seeds, episode_seeds)

    def receive(self, timeout: float) -> tuple[str, object]:
        """("message", the child's next message or None) or ("died", why): data, not a raised error, so rank 0
        raises SamplerDied itself."""
        try:
            return "message", self.sampler.receive(timeout)
        except SamplerDied as e:
            return "died", str(e)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


class RaySampler:
    """Rank 0's handle on the sampler actor, with SamplerProcess's methods (worker/trainer/pipeline.py's host)."""

    def __init__(self, actor, spec, *, version: int, state: dict, egress=None, secrets=None):
        import ray

        self.actor, self._death = actor, None
        self.pid = self._call(actor.start.remote(spec.model_dump_json(), version, ray.put(state), egress,
                                                 dict(secrets or {})))

    def publish(self, version: int, state: dict) -> None:
        import ray

        self._call(self.actor.publish.remote(version, ray.put(state)))  # through the object store

    def request(self, step: int, rows: list[dict], seeds: list[int], episode_seeds: list[int] = ()) -> None:
        self._call(self.actor.request.remote(step, rows, seeds, list(episode_seeds)))

    def receive(self, timeout: float):
        kind, value = self._call(self.actor.receive.remote(timeout), timeout + RECEIVE_TIMEOUT_S)
        if kind == "died":
            self._death = value
            raise SamplerDied(value)
        return value

    def alive(self) -> bool:
        return self._death is None

    def death(self) -> str:
        return self._death or "the sampler actor is gone"

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (the driver kills the actor itself with the ranks)."""
        if self._death is not None:
            return
        try:
            self._call(self.actor.close.remote(), timeout)
        except SamplerDied:
            pass

    def _call(self, ref, timeout: float | None = None):
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._death = f"the sampler actor died or stopped answering: {type(e).__name__}: {str(e)[:500]}"
            raise SamplerDied(self._death) from None
