"""One training process under torchrun: join the process group and run the ordinary Trainer.

    torchrun --nproc-per-node N -m worker.torchrun.rank SPEC_JSON RUN_DIR [--no-resume]

(started by launch.run_distributed, which listens on the socket named in
CISPO_RANK0_SOCKET). Rank 0 relays the trainer's callbacks to the job runner;
the other ranks' callbacks do nothing, and all ranks take rank 0's answer to
`should_stop`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from service.egress import EgressPolicy
from service.job_spec.spec import JobSpec
from worker.distributed import group
from worker.torchrun.launch import CHANNEL_ENV, NO_RESUME, write_rank_error
from worker.rewards.engine import ScoringContext
from worker.rewards.judge import JudgeEndpoint


class Rank0Channel:
    """Rank 0's end of the socket: one JSON line out, one JSON line back."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")

    def receive(self) -> dict:
        line = self.reader.readline()
        if not line:
            raise ConnectionError("the job runner closed the channel")
        return json.loads(line)

    def request(self, kind: str, **fields) -> dict:
        self.sock.sendall(json.dumps({"kind": kind, **fields}).encode() + b"\n")
        return self.receive()

    def tell(self, kind: str, **fields) -> None:
        """A last message that gets no answer (the result or an error)."""
        self.sock.sendall(json.dumps({"kind": kind, **fields}).encode() + b"\n")


class RankCallbacks:
    """Trainer callbacks on every rank: rank 0 forwards them, all ranks share one stop decision."""

    def __init__(self, channel: Rank0Channel | None):
        self.channel = channel

    def _forward(self, kind: str, **fields) -> dict:
        return self.channel.request(kind, **fields) if self.channel is not None else {}

    def on_step(self, step, metrics): self._forward("step", step=step, metrics=metrics)
    def on_eval(self, step, metrics): self._forward("eval", step=step, metrics=metrics)
    def on_checkpoint(self, step, path): self._forward("checkpoint", step=step, path=str(path))
    def on_reward_errors(self, step, errors): self._forward("reward_errors", step=step, errors=errors)
    def on_samples(self, step, samples): self._forward("samples", step=step, samples=samples)
    def on_preflight(self, metrics): self._forward("preflight", metrics=metrics)
    def on_no_signal(self, step, steps): self._forward("no_signal", step=step, steps=steps)
    def event(self, message): self._forward("event", message=message)

    def should_stop(self) -> bool:
        return bool(group.from_rank0(self._forward("should_stop").get("stop", False)))


def scoring_from_wire(context: dict) -> ScoringContext:
    judge = JudgeEndpoint(**context["judge"]) if context["judge"] else None
    egress = EgressPolicy(**{**context["egress"], "allow": tuple(context["egress"]["allow"])})
    return ScoringContext(secrets=context["secrets"], egress=egress, judge=judge)


def main(argv: list[str]) -> int:
    spec_path, run_dir, resume = Path(argv[0]), Path(argv[1]), NO_RESUME not in argv[2:]
    group.init_from_env()
    channel = Rank0Channel(os.environ[CHANNEL_ENV]) if group.rank() == 0 else None
    try:
        # Secrets pass from rank 0 to the other ranks in memory, between this job's own processes.
        scoring = scoring_from_wire(group.from_rank0(channel.receive() if channel else None))
        from worker.trainer.loop import Trainer  # after the group exists: the Trainer shards the model

        spec = JobSpec.model_validate_json(spec_path.read_text())
        callbacks = RankCallbacks(channel)
        trainer = Trainer(spec, run_dir, scoring=scoring, resume=resume, progress=callbacks.event)
        if trainer.step:
            callbacks.event(f"Resumed from the checkpoint at step {trainer.step} with {group.world_size()} processes")
        result = trainer.run(callbacks)
        if channel is not None:
            channel.tell("done", steps_done=result.steps_done, stopped=result.stopped,
                         last_checkpoint=str(result.last_checkpoint) if result.last_checkpoint else None,
                         first_eval=result.first_eval, last_eval=result.last_eval)
        # No rank leaves before rank 0 has reported: a rank that finishes first and then dies in its teardown
        # (gloo can abort there) would make torchrun kill rank 0 with the result unsent.
        group.from_rank0(None)
        return 0
    except Exception as e:
        try:
            write_rank_error(run_dir, group.rank(), e)
        except OSError:
            pass
        if channel is not None:
            try:
                channel.tell("error", type=type(e).__name__, message=str(e))
            except OSError:
                pass
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
