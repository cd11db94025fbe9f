"""Numbered policy versions: what the trainer sends its sampler process, and how old a sample may be.

Version v is the policy after v trainer steps (v optimizer updates of the
trained weights): the starting weights are version `step` of the run that
loads them. Only the trainable tensors travel (the LoRA adapter, or every
weight under full fine-tuning); the sampler already holds the frozen base.

A sample produced by version v and trained on at trainer step k (when the
trainer's weights are version k) lags k - v versions. The pipeline never lets
the sampler start a batch more than `max_staleness` versions ahead of its
weights, and the trainer checks each sample again before training on it
(`fresh_sequences`): a sample older than the bound is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from worker.distributed import group


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors by name, as CPU copies the sender may keep no reference to."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def gathered_trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """trainable_state of a model FSDP shards over the ranks: whole tensors on rank 0, {} on the others.

    Collective (every rank calls it): each trainable tensor is all-gathered in turn, so a rank holds one whole
    tensor at a time beyond its shards. With one process, trainable_state."""
    if not group.active():
        return trainable_state(model)
    state = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        if group.rank() == 0:
            state[name] = whole.detach().to("cpu", copy=True)
    return state


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a version's tensors into the same-named parameters of `model` (built from the same spec)."""
    params = dict(model.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise ValueError(f"policy version names parameters the sampler's model lacks: {missing[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))


@dataclass(frozen=True)
class Freshness:
    kept: list[int]  # sequence indices trained on
    dropped: int  # sequences older than the bound
    lag_mean: float  # over the kept sequences (0 when none)
    lag_max: int


def fresh_sequences(versions: list[int], current: int, max_staleness: int) -> Freshness:
    """Which sequences (tagged with their producing version) a trainer at version `current` may train on."""
    lags = [current - v for v in versions]
    if any(lag < 0 for lag in lags):
        raise ValueError(f"a sample is tagged with version {max(versions)}, newer than the trainer's {current}")
    kept = [i for i, lag in enumerate(lags) if lag <= max_staleness]
    kept_lags = [lags[i] for i in kept]
    return Freshness(kept=kept, dropped=len(lags) - len(kept),
                     lag_mean=sum(kept_lags) / len(kept_lags) if kept_lags else 0.0,
                     lag_max=max(kept_lags, default=0))
