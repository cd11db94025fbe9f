"""Asynchronous rollouts on every rank: rank 0 runs the pipeline, each rank trains its share of its batches.

With one process this is the RolloutPipeline itself. Under FSDP (resources.gpus
> 1) only rank 0 starts a sampler process and a scoring thread; after each
update every rank takes part in gathering the whole trainable tensors from their
shards (the adapter, or every weight), which rank 0 sends on as the next policy
version. Each batch rank 0 takes is cut into the ranks' contiguous shares, whole
groups each, as the synchronous loop splits its prompts, and scattered with the
version tag of every sequence.

Why one sampler on rank 0 rather than one per rank, each sampling its share:
a sampler per rank would hold a whole model copy per rank (N copies instead of
one) and need every rank to gather the whole weights anyway (a sampler shard
cannot decode alone); one sampler samples the whole batch in the order one
process does, so the batches, prompts and seeds are those of a one-process job.
The cost is one scatter of each batch (token ids and log-probs, small beside
the weights) and rank 0's process carrying the sampler's memory.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from service.job_spec.spec import JobSpec
from worker.distributed import group
from worker.rewards.engine import ScoringContext
from worker.rollout.policy_versions import gathered_trainable_state
from worker.trainer.feedback import Feedback
from worker.trainer.pipeline import Draw, RolloutPipeline, SamplerHost, ScoredBatch
from worker.trainer.rewards import Scorer, Scores


class RankPipeline:
    def __init__(self, spec: JobSpec, model: torch.nn.Module, *, step: int, scorer: Scorer | None, draw: Draw,
                 scoring: ScoringContext | None = None, sampler_host: SamplerHost | None = None):
        """Every rank constructs it together (the weights are gathered); `draw`, `scorer` and `sampler_host` (where
        the sampler runs: a Ray actor on that backend, else rank 0's child process) serve rank 0 only."""
        self.rank, self.world = group.rank(), group.world_size()
        state = gathered_trainable_state(model)
        self.pipeline = RolloutPipeline(spec, state, step=step, scorer=scorer, draw=draw, scoring=scoring,
                                        sampler_host=sampler_host) if self.rank == 0 else None

    def take(self, step: int) -> ScoredBatch:
        """This rank's share of step `step`'s scored batch (collective)."""
        parts = None
        if self.pipeline is not None:
            batch = self.pipeline.take(step)
            parts = [batch_share(batch, r, self.world) for r in range(self.world)]
        return group.scatter_from_rank0(parts)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Gather the weights after `version` trainer steps and send them to the sampler (collective)."""
        state = gathered_trainable_state(model)
        if self.pipeline is not None:
            self.pipeline.publish(version, state)

    def data_state(self) -> dict | None:
        """Rank 0's: the data position before the oldest batch requested but not trained on (None: none is)."""
        return self.pipeline.data_state() if self.pipeline is not None else None

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


def batch_share(batch: ScoredBatch, rank: int, world: int) -> ScoredBatch:
    """Rank `rank`'s contiguous share of a batch's sequences (whole groups: the sequences are prompt-major).

    Reward and environment error messages are not per sequence: rank 0's share carries all of them and the
    others none, so the ranks' messages concatenated are the batch's, each once."""
    if world == 1:
        return batch
    n = len(batch.rollout) // world
    part = slice(rank * n, (rank + 1) * n)
    rollout = replace(batch.rollout, **{f.name: _cut(getattr(batch.rollout, f.name), part)
                                        for f in fields(batch.rollout)})
    errors = batch.feedback.errors if rank == 0 else []
    scores = batch.feedback.scores
    if scores is not None:
        scores = Scores(scores.rewards[part], list(scores.errors) if rank == 0 else [],
                        {name: values[part] for name, values in scores.components.items()})
    feedback = Feedback(batch.feedback.turn_rewards[part], errors, scores)
    return replace(batch, rollout=rollout, feedback=feedback, versions=batch.versions[part])


def _cut(values, part: slice):
    """A per-sequence field's share; a field the rollout left empty (or None) stays so."""
    return values[part] if values else values
