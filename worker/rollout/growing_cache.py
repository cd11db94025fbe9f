"""A dynamic KV cache that writes each step's keys and values into buffers sized once for the whole decode.

transformers' DynamicCache concatenates at every step: each layer's whole
cache is copied per token, O(length^2) bytes over a completion (at 16 rows,
2 KV heads of 64 and 24 layers: 0.4 GB copied per step at 1k tokens, 25%
of the 0.5B model's weights). Here each layer holds (rows, heads, capacity,
dim) buffers, a step writes its column in place, and attention sees a view
of the filled columns only: the same keys and values, so the same logits,
without the copies and without attending over unfilled (masked) columns as
a static cache would. Dropping finished rows copies the filled part of the
rows kept, as DynamicCache's selection does.
"""

from __future__ import annotations

from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["growing_cache"]


class _GrowingLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.filled = capacity, 0
        self.key_buffer = self.value_buffer = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, D = key_states.shape
        self.key_buffer = key_states.new_empty((B, H, self.capacity, D))
        self.value_buffer = value_states.new_empty((B, H, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {end} asked")
        self.key_buffer[:, :, self.filled : end] = key_states
        self.value_buffer[:, :, self.filled : end] = value_states
        self.filled = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if not self.is_initialized:
            return
        self.key_buffer = _select_rows(self.key_buffer, indices, self.filled)
        self.value_buffer = _select_rows(self.value_buffer, indices, self.filled)
        self.keys, self.values = self.key_buffer[:, :, : self.filled], self.value_buffer[:, :, : self.filled]

    def reset(self) -> None:
        super().reset()
        self.filled, self.key_buffer, self.value_buffer = 0, None, None


def _select_rows(buffer: Tensor, indices: Tensor, filled: int) -> Tensor:
    """New buffers of the same capacity holding rows `indices` (repeats allowed) of the filled columns."""
    selected = buffer.new_empty((indices.shape[0], *buffer.shape[1:]))
    selected[:, :, :filled] = buffer[indices, :, :filled]
    return selected


def growing_cache(config, capacity: int) -> DynamicCache:
    """transformers' DynamicCache for `config`'s model, each full-attention layer holding up to `capacity`
    positions (prompt and new tokens) in place; other layer kinds (sliding windows) stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [_GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
