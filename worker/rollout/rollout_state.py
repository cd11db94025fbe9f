"""What a model's rollouts keep between them (static caches, weight copies), and freeing it before an update.

Small models keep it: the next rollout replays its CUDA graphs at the same
addresses. A large model's caches and copies would otherwise sit through the
update, which needs that memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.rollout.effective_weights import kept_copies
from worker.rollout.static_decode import static_caches

__all__ = ["rollout_state_bytes", "release_rollout_state", "RELEASE_FRACTION"]

RELEASE_FRACTION = 0.1  # kept rollout state above this share of the GPU's memory is freed after the rollout


def rollout_state_bytes(model) -> int:
    """Bytes held between rollouts for `model`: its static caches and the kept weight copies of its modules."""
    held = sum(t.numel() * t.element_size() for cache in static_caches.get(model, {}).values()
               for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, Tensor))
    for module in model.modules():
        held += sum(p.numel() * p.element_size() for p in kept_copies.get(module, {}).values())
    return held


def release_rollout_state(model, *, above_bytes: int | None = None) -> bool:
    """Free the static caches and weight copies kept for `model` when they hold more than `above_bytes`
    (default: RELEASE_FRACTION of the GPU's memory; on a CPU they are kept), and return the memory to the GPU.

    Small models keep them (the next rollout replays its CUDA graphs at the same addresses); a large model's
    caches and copies would otherwise sit through the update, which needs that memory. Returns whether it freed."""
    if above_bytes is None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            return False
        above_bytes = int(RELEASE_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    if rollout_state_bytes(model) <= above_bytes:
        return False
    static_caches.pop(model, None)
    for module in model.modules():
        kept_copies.pop(module, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True
