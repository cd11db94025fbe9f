"""training.pass_rate_filter: after a step, retire the prompts its groups show to be solved (or without signal).

Every process holds the same sampler and calls this with the whole step's rewards (gathered, in batch order),
so the samplers stay equal; the retired rows go into checkpoints with the sampler's state.
"""

from __future__ import annotations

from torch import Tensor

from service.schemas.recipe import PassRateFilterSpec
from worker.cispo import prompts_to_retire
from worker.trainer.data import PromptSampler


def retire_solved(sampler: PromptSampler, rows: list[int], rewards_PG: Tensor, spec: PassRateFilterSpec) -> int:
    """Retire those of the step's prompts (`rows`: their indices, in batch order) whose group passed the filter;
    returns how many rows are retired in all. The rows are the step's own, not the sampler's last draw: an
    asynchronous job has drawn the next steps' prompts before this one ends."""
    if rewards_PG.shape[0] != len(rows):
        raise ValueError(f"{rewards_PG.shape[0]} groups for a batch of {len(rows)} prompts")
    retire_P = prompts_to_retire(rewards_PG, threshold=spec.threshold, pass_reward=spec.pass_reward,
                                 drop_zero_variance=spec.drop_zero_variance)
    sampler.retire([row for row, retire in zip(rows, retire_P.tolist()) if retire])
    return len(sampler.retired)
