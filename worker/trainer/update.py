"""The update phase of one trainer step: several CISPO optimizer steps on one rollout batch.

logp_old is frozen at rollout time (a no-grad forward before the first
optimizer step), so later mini-batches see ratios != 1 and the CISPO weight
matters. When the batch feeds exactly one optimizer step the ratio is 1 by
construction and that extra forward is skipped. With asynchronous rollouts
(rollout.max_staleness > 0) logp_old is instead the sampler's own log-probs,
taken by the policy version that produced each token (worker/trainer/pipeline.py).

Sequences are collated with the rollout's action mask, so prompt and
environment tokens are context only; advantages arrive per action token
(one value per sequence is broadcast), which is how per-turn advantages
reach each turn's tokens. With training.pack_tokens each forward and backward
is one packed row of whole sequences instead of a padded micro-batch
(worker/trainer/packing.py); the log-probs come back one row per sequence,
so nothing after the forward changes.

What the update runs (the kept sequences, advantages, logp_old's source, the
optimizer steps' sequences, normalisers and prompt weights) is
worker/trainer/plan.py's plan, the one a resident job's batched update runs
too; this module runs its forwards and backwards.

With several processes (FSDP2) each rank updates on its own sequences of the
plan, whose normalisers are summed over ranks, so the sharded losses add up
to the global token mean; FSDP averages gradients over ranks, so each rank's
loss is scaled by the world size to make that average the sum. Every rank
runs the same number of micro-batches per optimizer step (FSDP's collectives
pair up), a rank short of sequences running a zero-weighted one.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

from service.job_spec.spec import JobSpec
from worker.distributed import group
from worker.distributed.shard import unsharded
from worker.trainer.metrics import UpdateStats
from worker.model.lora_forward import fused_lora_linears
from worker.model.policy import Policy
from worker.model.lean_backward import lean_backward
from worker.rollout.rollout import Rollout
from worker.trainer.packing import collate_packed, pack_rows
from worker.trainer.scoring import collate_sequences, sequence_logprobs
from worker.trainer.plan import plan_update


def _chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def micro_batches(indices: list[int], lengths: list[int], size: int) -> list[list[int]]:
    """Chunks of `size` sequences, similar lengths together, so a micro-batch pads little.

    Which sequences share an optimizer step is decided before (the shuffled
    mini-batch); grouping them by length only changes how the step's
    gradient is accumulated, not what it is.
    """
    return _chunks(sorted(indices, key=lambda i: lengths[i]), size)


def job_micro_batches(spec: JobSpec, indices: list[int], lengths: list[int]) -> list[list[int]]:
    """The sequences of each forward and backward of the job's update: a packed row's (training.pack_tokens), or a
    padded micro-batch's of micro_batch_size sequences."""
    if spec.training.pack_tokens is not None:
        return pack_rows(indices, lengths, spec.training.pack_tokens)
    return micro_batches(indices, lengths, spec.training.micro_batch_size)


def shares_prefixes(spec: JobSpec) -> bool:
    """Whether the job's micro-batches hold a group's shared prompt once (worker/trainer/scoring.py). Not with
    gradient checkpointing (transformers then keeps no cache to carry the prompt's keys and values) nor under FSDP
    (tried: FSDP2 reshards after each forward, and the backward through the earlier prompt pass then meets freed
    parameter storage); a packed row holds whole sequences."""
    return not spec.training.gradient_checkpointing and not group.active() and spec.training.pack_tokens is None


def head_dtype(spec: JobSpec) -> torch.dtype | None:
    """The dtype of the update's LM-head matmul: float32 with training.lm_head_float32 (ScaleRL's FP32 logits),
    else the forward's own."""
    return torch.float32 if spec.training.lm_head_float32 else None


def _per_sequence(values_BT: Tensor, action_mask_BT: Tensor) -> list[Tensor]:
    """Split the action-token values of each row into one 1-D tensor per sequence."""
    lengths = action_mask_BT.sum(-1).long().tolist()
    return list(values_BT[action_mask_BT.bool()].split(lengths))


class Updater:
    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer, spec: JobSpec):
        self.policy, self.optimizer, self.spec = policy, optimizer, spec
        self.training = spec.training
        self.temperature = spec.sampling.temperature
        self.head_dtype = head_dtype(spec)
        self.share_prefixes = shares_prefixes(spec)
        self.pack_tokens = spec.training.pack_tokens  # None: padded micro-batches of micro_batch_size sequences

    def _batch(self, rollout: Rollout, idx: list[int]):
        if self.pack_tokens is not None:
            return collate_packed([rollout.token_ids[i] for i in idx], [rollout.action_mask[i] for i in idx],
                                  device=self.policy.device)
        return collate_sequences(
            [rollout.token_ids[i] for i in idx],
            [rollout.action_mask[i] for i in idx],
            pad_id=self.policy.tokenizer.pad_token_id,
            device=self.policy.device,
            share_prefixes=self.share_prefixes,
        )

    @contextmanager
    def _frozen(self, reference: bool):
        """The module that scores as the reference (or as the current policy), without gradients."""
        if reference:
            with self.policy.reference() as module:
                yield module
        else:
            with torch.no_grad():
                yield self.policy.model

    def _frozen_logprobs(self, rollout: Rollout, indices: list[int], *, reference: bool) -> dict[int, Tensor]:
        """Per-sequence action-token log-probs under the rollout (or reference) policy, no grad."""
        model = self.policy.model
        was_training = model.training
        model.eval()  # the sampler ran without dropout
        result: dict[int, Tensor] = {}
        with unsharded(model, self.policy.reference_model if reference else None):
            lengths = [len(ids) for ids in rollout.token_ids]
            for idx in job_micro_batches(self.spec, indices, lengths):
                batch = self._batch(rollout, idx)
                with self._frozen(reference) as scorer, self.policy.autocast():
                    logp, _ = sequence_logprobs(scorer, batch, temperature=self.temperature,
                                                chunk_size=self.training.logprob_chunk_size,
                                                head_dtype=self.head_dtype)
                result.update(zip(idx, _per_sequence(logp, batch.sequence_action_mask_BT)))
        model.train(was_training)
        return result

    def run(self, rollout: Rollout, advantages: Tensor | list[Tensor], indices: list[int], *,
            step: int = 0) -> UpdateStats:
        """Optimizer steps over the sequences `indices` of the rollout, at trainer step `step` (which keys the
        mini-batch shuffle).

        `advantages` holds, per sequence, one value per action token (or one value per sequence).
        Sequences without action tokens (an episode whose reset failed) carry no gradient and are skipped.
        """
        with self._lora_forward(), lean_backward(self.policy.model, norms=not group.active()):
            return self._run(rollout, advantages, indices, step)

    def _lora_forward(self):
        """LoRA linears adding their adapter's output in one addmm (worker/model/lora_forward.py); in one process
        only (under FSDP2 the module's parameters are sharded between calls)."""
        return fused_lora_linears(self.policy.model) if self.policy.is_lora and not group.active() else nullcontext()

    def _run(self, rollout: Rollout, advantages: Tensor | list[Tensor], indices: list[int], step: int) -> UpdateStats:
        stats = UpdateStats()
        plan = plan_update(rollout, advantages, indices, step=step, spec=self.spec)
        if plan is None:
            return stats
        if plan.needs_old:
            plan.old = self._frozen_logprobs(rollout, plan.indices, reference=False)
        if plan.needs_ref:
            plan.ref = self._frozen_logprobs(rollout, plan.indices, reference=True)
        model = self.policy.model
        model.train()
        params = self.policy.trainable_parameters()
        lengths = [len(ids) for ids in rollout.token_ids]
        world = group.world_size()
        for opt_step in plan.steps:
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            micros = job_micro_batches(self.spec, opt_step.sequences, lengths)
            for _ in range(group.max_all(len(micros)) - len(micros)):
                self._zero_weight_pass(rollout)
            for micro in micros:
                batch = self._batch(rollout, micro)
                with self.policy.autocast():  # the backward below runs outside it, as torch advises
                    logp, entropy = sequence_logprobs(
                        model, batch, temperature=self.temperature, chunk_size=self.training.logprob_chunk_size,
                        head_dtype=self.head_dtype,
                    )
                action_mask_BT = batch.sequence_action_mask_BT  # logp's layout: one row per sequence
                out = plan.loss(opt_step, micro, logp, action_mask_BT)
                (out.loss * world).backward()  # FSDP averages gradients over ranks; the sum is wanted
                step_loss += float(out.loss.detach())
                stats.add(out, float((entropy * action_mask_BT).sum()))
            plan.close_step(stats, params, self.optimizer, group.sum_all(step_loss))
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _zero_weight_pass(self, rollout: Rollout) -> None:
        """A forward and backward that adds nothing to the gradients but joins FSDP's collectives."""
        batch = self._batch(rollout, [0])
        with self.policy.autocast():
            logp, _ = sequence_logprobs(self.policy.model, batch, temperature=self.temperature,
                                        chunk_size=self.training.logprob_chunk_size, head_dtype=self.head_dtype)
        (logp.sum() * 0.0).backward()
