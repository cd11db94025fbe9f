"""What one trainer step's update does, before any forward: the plan both update paths run.

The trainer alone (worker/trainer/update.py: padded, packed or FSDP forwards) and the resident jobs on a shared
base (worker/multi/update.py: forwards routed across adapters) differ only in how they compute log-probs; which
sequences train, with which per-token advantages, against which logp_old, in which optimizer steps and with
which normaliser is decided here once, so the two cannot drift apart.

With several processes (FSDP2) each rank plans its own sequences of one global plan: the mini-batches are cut
from a shuffle of the whole batch's kept sequences (all ranks'), each rank taking its own, and each optimizer
step's normaliser is summed over the ranks, so the sharded losses add up to the global mean. Outside a process
group (one process, or every resident job) the gathers return this process's values alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from service.job_spec.spec import JobSpec
from worker.cispo import LossOutput, sequence_weights
from worker.distributed import group
from worker.model.streams import generator
from worker.rollout.rollout import Rollout
from worker.trainer.metrics import UpdateStats
from worker.trainer.step import micro_batch_loss, optimizer_step


def shuffled_mini_batches(indices: list[int], seed: int, step: int, epoch: int, parts: int) -> list[list[int]]:
    """The sequences `indices` shuffled by a stream keyed by the job seed, the trainer step and the epoch, cut
    into `parts` mini-batches (fewer when there are fewer sequences): the order of the epoch's optimizer steps."""
    shuffle = torch.randperm(len(indices), generator=generator("minibatch", seed, step, epoch))
    order = torch.tensor(indices, dtype=torch.long)[shuffle]
    return [cut.tolist() for cut in order.tensor_split(min(parts, len(indices)))]


def rank_mini_batches(spec: JobSpec, indices: list[int], sequences: int, step: int, epoch: int) -> list[list[int]]:
    """This rank's sequences of each of the epoch's mini-batches (a list for every mini-batch, maybe empty).

    `indices` are this rank's kept sequences of its `sequences`; the ranks hold consecutive shares of the batch.
    """
    shares = group.gather_objects((sequences, indices))  # in rank order
    starts = [sum(n for n, _ in shares[:r]) for r in range(len(shares))]
    offset = starts[group.rank()]
    everyone = [start + i for start, (_, kept) in zip(starts, shares) for i in kept]
    cuts = shuffled_mini_batches(everyone, spec.seed, step, epoch, spec.training.mini_batches)
    return [[i - offset for i in cut if offset <= i < offset + sequences] for cut in cuts]


def reuses_current_logprobs(spec: JobSpec) -> bool:
    """One optimizer step per rollout: the policy has not moved since sampling, so logp_old is the current
    pass's own log-probs, detached (ratio exactly 1), and the frozen forward that would recompute them is
    skipped (a third of the update's compute with LoRA)."""
    return spec.training.updates_per_rollout == 1


@dataclass
class OptimizerStep:
    """One optimizer step: this rank's sequences of it (maybe none), its normaliser (every rank's action tokens,
    sequences or prompts) and, under prompt normalisation, each sequence's weight."""

    sequences: list[int]
    normalizer: float
    weight_of: dict[int, float] | None


@dataclass
class UpdatePlan:
    spec: JobSpec
    indices: list[int]  # the sequences trained on: kept, with action tokens
    token_adv: dict[int, Tensor]  # per sequence, one advantage per action token
    sampler: dict[int, Tensor] | None  # the rollout engine's log-probs, for the TIS correction (None: none)
    old: dict[int, Tensor] | None  # logp_old when the plan knows it (the sampler's, asynchronously)
    needs_old: bool  # logp_old from a frozen forward under the current policy, before the first step
    needs_ref: bool  # the reference's log-probs (a KL term)
    steps: list[OptimizerStep] = field(default_factory=list)  # in order, every epoch's
    ref: dict[int, Tensor] | None = None  # filled by the path's frozen forward when needs_ref

    def loss(self, opt_step: OptimizerStep, micro: list[int], logp: Tensor, action_mask_BT: Tensor) -> LossOutput:
        """The CISPO loss of the micro-batch `micro` of `opt_step`, its rows' log-probs `logp`."""
        return micro_batch_loss(self.spec, micro, logp, action_mask_BT, opt_step.normalizer,
                                token_adv=self.token_adv, old=self.old, ref=self.ref, sampler=self.sampler,
                                weight_of=opt_step.weight_of)

    def close_step(self, stats: UpdateStats, params, optimizer: torch.optim.Optimizer, loss: float) -> None:
        """Clip the step's accumulated gradients and step the optimizer; record its norm and (global) loss."""
        stats.grad_norms.append(optimizer_step(params, optimizer, self.spec.optimizer.max_grad_norm))
        stats.step_losses.append(loss)


def plan_update(rollout: Rollout, advantages: Tensor | list[Tensor], indices: list[int], *, step: int,
                spec: JobSpec) -> UpdatePlan | None:
    """The update of trainer step `step` (which keys the mini-batch shuffle) over the sequences `indices` of the
    rollout; None when no rank has a sequence to train on (every rank gets None together).

    `advantages` holds, per sequence, one value per action token (or one value per sequence). Sequences without
    action tokens (an episode whose reset failed) carry no gradient and are left out.
    """
    tc, counts = spec.training, rollout.action_counts
    indices = [i for i in indices if counts[i] > 0]
    if group.max_all(len(indices)) == 0:
        return None
    if isinstance(advantages, Tensor):
        # one op, not one per row
        advantages = advantages.repeat_interleave(torch.tensor(counts, device=advantages.device)).split(counts)
    sampler = None if rollout.sampler_logprobs is None else {
        i: torch.tensor(rollout.sampler_logprobs[i], dtype=torch.float32) for i in indices}
    old, needs_old = None, not reuses_current_logprobs(spec)
    if spec.rollout.max_staleness > 0:
        # Asynchronous rollouts: logp_old is the sampler's own log-prob under the version that produced the
        # token, so the ratio carries the staleness (and the sampler's numerical mismatch) and ratio_max caps
        # it; the TIS factor exp(logp_old - logp_sampler) would be 1, so it is left out.
        if sampler is None:
            raise ValueError("rollout.max_staleness > 0 needs the sampler's log-probs of every sequence")
        old, sampler, needs_old = sampler, None, False
    plan = UpdatePlan(spec, indices, {i: advantages[i] for i in indices}, sampler, old, needs_old,
                      needs_ref=spec.loss.kl_beta > 0)
    normalization = spec.loss.normalization
    for epoch in range(tc.update_epochs):
        for mini in rank_mini_batches(spec, indices, len(rollout), step, epoch):
            weights, share = sequence_weights(normalization, [counts[i] for i in mini],
                                              [i // tc.group_size for i in mini])
            normalizer = group.sum_all(share)
            if normalizer == 0:  # no rank has a sequence for this step
                continue
            plan.steps.append(OptimizerStep(mini, normalizer,
                                            dict(zip(mini, weights)) if normalization == "prompt" else None))
    return plan
