"""One training rank as a Ray actor: today's Trainer under the environment torchrun would give it.

The driver starts one per rank, tells each its environment (layout.py) and
hands it the job's files (files.py); rank 0 relays the Trainer's callbacks
to the driver over two Ray queues (one request, one answer, as
worker/torchrun/rank.py does over its socket) and sends each checkpoint's
files with its request. A rank's own directory is a temporary one on its node.
CUDA is first touched only after the environment is set (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import traceback
from functools import partial
from pathlib import Path

from worker.torchrun.rank import RankCallbacks
from worker.ray_driver.files import pack, unpack
from worker.ray_driver.sampler_actor import RaySampler

RUN = "run"  # the rank's run directory, under its root


class QueueChannel:
    """Rank 0's end of the channel to the driver: a request out, its answer back."""

    def __init__(self, requests, answers):
        self.requests, self.answers = requests, answers

    def request(self, kind: str, **fields) -> dict:
        self.requests.put({"kind": kind, **fields})
        return self.answers.get()


def localize(spec_json: str, root: Path):
    """The spec with its shipped files' relative names made paths under this rank's root."""
    from service.job_spec.spec import JobSpec

    spec = JobSpec.model_validate_json(spec_json)
    data = {"train_file": str(root / spec.data.train_file)}
    if spec.data.validation_file:
        data["validation_file"] = str(root / spec.data.validation_file)
    update = {"data": spec.data.model_copy(update=data)}
    if spec.init_from:
        update["init_from"] = str(root / spec.init_from)
    return spec.model_copy(update=update)


class RankActor:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="cispo-ray-rank-"))

    def where(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, spec_json: str, files: dict[str, bytes], env: dict[str, str], resume: bool,
            context: dict | None, channel: QueueChannel | None, sampler=None) -> dict:
        """Train as this rank; returns rank 0's result (others: {}) or the error, as data ({"error": ...}).
        `sampler`: rank 0's, the handle of the job's sampler actor (asynchronous rollouts: sampler_actor.py)."""
        os.environ.update(env)
        try:
            unpack(files, self.root)
            return self._train(localize(spec_json, self.root), resume, context, channel, sampler)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()[-3000:]}
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _train(self, spec, resume: bool, context: dict | None, channel: QueueChannel | None, sampler) -> dict:
        import torch.distributed as dist

        from worker.distributed import group
        from worker.torchrun.rank import scoring_from_wire

        group.init_from_env()
        try:
            # Secrets reach rank 0 only (in the call, never the environment) and pass to the others in memory.
            scoring = scoring_from_wire(group.from_rank0(context))
            from worker.trainer.loop import Trainer  # after the group exists: the Trainer shards the model

            callbacks = RayRankCallbacks(channel if group.rank() == 0 else None)
            host = partial(RaySampler, sampler) if sampler is not None and group.rank() == 0 else None
            # vLLM samples the training batches in the sampler actor only: an engine in the ranks would be handed
            # FSDP shards and meet their process group, so their evaluations and pre-flight use our decode loop.
            trainer = Trainer(spec, self.root / RUN, scoring=scoring, resume=resume, progress=callbacks.event,
                              sampler_host=host, own_engine="hf" if spec.rollout.engine == "vllm" else None)
            if trainer.step:
                callbacks.event(f"Resumed from the checkpoint at step {trainer.step} with {group.world_size()} "
                                "processes on Ray")
            result = trainer.run(callbacks)
            if group.rank() != 0:
                return {}
            return {"steps_done": result.steps_done, "stopped": result.stopped,
                    "last_checkpoint": result.last_checkpoint.name if result.last_checkpoint else None,
                    "first_eval": result.first_eval, "last_eval": result.last_eval}
        finally:
            dist.destroy_process_group()


class RayRankCallbacks(RankCallbacks):
    """RankCallbacks whose checkpoints carry their files: the driver's node cannot read this one's disk."""

    def on_checkpoint(self, step, path):
        if self.channel is None:
            return
        import ray

        # In a list, so Ray hands the driver the reference (fetched there), not the bytes through the queue.
        ref = ray.put(pack({".": Path(path)}))
        self._forward("checkpoint", step=step, name=Path(path).name, files=[ref])
