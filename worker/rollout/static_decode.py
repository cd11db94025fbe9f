"""Compiled decoding (CUDA): a static KV cache and one torch.compile'd decode step.

mode "reduce-overhead" records CUDA graphs; shapes are bucketed so few
compiles happen; finished rows stay in the batch (static shapes) and the
loop ends once all rows are done. Batches are padded up to a batch bucket,
and one static cache is kept per (batch bucket, length bucket), the last few
used, so eval batches and later turns reuse a graph near their size and do
not evict the training shape's cache (and its CUDA graphs' addresses). If
compiling a shape fails, that rollout decodes eagerly and the failure is
kept for the trainer to report (`take_compile_fallbacks`: a metric; the
model's first failure also a warn event, worker/model/optional_swaps.py);
the shape is compiled again next time, up to MAX_COMPILE_TRIES failures.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict

import torch
from torch import Tensor
from transformers import StaticCache

from worker.model.cache_arg import CACHE_ARG
from worker.model.optional_swaps import report_once
from worker.rollout.token_picking import Picker

__all__ = ["static_loop", "compiled_step", "decode_step", "shape_key", "batch_bucket", "compile_allowed",
           "compile_failed", "take_compile_fallbacks", "static_caches", "CACHE_BUCKET", "STATIC_CACHES_KEPT",
           "MAX_COMPILE_TRIES"]

log = logging.getLogger(__name__)

CACHE_BUCKET = 128  # static cache lengths are rounded up to this, so a new prompt length rarely recompiles
# Kept between rollouts so that tensor addresses stay put and CUDA graphs replay instead of re-recording.
_compiled_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> compiled decode step
static_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape key: StaticCache}, LRU
STATIC_CACHES_KEPT = 4  # per model: a training shape, an eval shape, a later turn's or a smaller last batch's
MAX_COMPILE_TRIES = 3  # failures of one shape before it decodes eagerly for the rest of the process
_compile_failures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape key: failures}
_fallbacks: list[str] = []  # compile failures not yet reported (take_compile_fallbacks)


def decode_step(model, ids_BT, mask_BL, positions_BT, cache):
    """(B, V) each row's next-token logits after `ids_BT`, whose keys and values go into `cache` (the LM head on the
    last position only): the one forward of every decode loop, prefill or step (T = 1)."""
    return model(input_ids=ids_BT, attention_mask=mask_BL, position_ids=positions_BT, **{CACHE_ARG: cache},
                 use_cache=True, logits_to_keep=1).logits[:, -1]


def compiled_step(model):
    step = _compiled_steps.get(model)
    if step is None:
        step = _compiled_steps[model] = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    return step


def static_loop(model, ids, mask, positions, P, max_new, pick: Picker, eos_id, *, step=decode_step,
                check_every: int = 16) -> Tensor:
    """Decode with a preallocated cache and one (compiled) step of fixed shapes; finished rows ride along.

    The batch is padded up to its bucket (`shape_key`) with copies of the first row (a real prompt: no row
    attends to nothing); their logits are never picked from and their tokens never returned."""
    B = ids.shape[0]
    rows, total = shape_key(B, P + max_new)
    fill = torch.cat([torch.arange(B, device=ids.device), torch.zeros(rows - B, dtype=torch.long, device=ids.device)])
    full_mask = torch.zeros((rows, total), dtype=mask.dtype, device=mask.device)
    full_mask[:, : mask.shape[1]] = mask[fill]
    positions = positions[fill]
    cache = _static_cache(model, rows, total)
    logits = model(input_ids=ids[fill, :P], attention_mask=full_mask[:, :P], position_ids=positions[:, :P],
                   **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    for t in range(max_new):
        token = pick(logits[:B], ids[:, : P + t], slice(None), t)
        ids[:, P + t] = token
        newly = (token == eos_id) & ~finished
        lengths = torch.where(newly, t + 1, lengths)
        finished |= newly
        if t == max_new - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):  # a sync only now and then
            break
        logits = step(model, token[fill, None], full_mask, positions[:, P + t : P + t + 1], cache).clone()
    return lengths


def batch_bucket(batch: int) -> int:
    """Rows a static cache and compiled graph are made for: the next power of two up to 8, then the next
    multiple of 8, so an eval batch, a later turn or a smaller last batch reuses a nearby shape's cache and
    graph instead of compiling and allocating its own."""
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


def shape_key(batch: int, length: int) -> tuple[int, int]:
    """(batch bucket, cache length rounded up to CACHE_BUCKET): what a static cache and a compiled graph are
    made for."""
    return batch_bucket(batch), -(-length // CACHE_BUCKET) * CACHE_BUCKET


def _static_cache(model, batch: int, length: int) -> StaticCache:
    """The model's static cache for this shape, emptied; a new one for a new shape (the least recently used of
    more than STATIC_CACHES_KEPT is dropped)."""
    key = (batch, length)
    caches = static_caches.setdefault(model, OrderedDict())
    if key in caches:
        caches.move_to_end(key)
        caches[key].reset()
        return caches[key]
    cache = caches[key] = StaticCache(config=model.config, max_cache_len=length)
    while len(caches) > STATIC_CACHES_KEPT:
        caches.popitem(last=False)
    return cache


def compile_failed(model, key: tuple[int, int], error: Exception) -> None:
    failures = _compile_failures.setdefault(model, {})
    failures[key] = failures.get(key, 0) + 1
    after = ("it is compiled again next time" if failures[key] < MAX_COMPILE_TRIES else
             f"after {failures[key]} failures this shape decodes eagerly from now on")
    message = (f"compiled decoding failed for batch bucket {key[0]}, cache length {key[1]} "
               f"({type(error).__name__}: {str(error)[:300]}); this rollout decoded eagerly, {after}")
    _fallbacks.append(message)  # counted in the step's metrics
    # one warn event for the model (the first failure); every one is logged with its traceback
    report_once(model, "compiled decoding", error, f"a rollout decoded eagerly instead, {after}")


def take_compile_fallbacks() -> list[str]:
    """The compile failures since the last call (each one a rollout that decoded eagerly), for the trainer to
    report as a metric and a warning event."""
    taken = _fallbacks[:]
    _fallbacks.clear()
    return taken



def compile_allowed(model, key: tuple[int, int]) -> bool:
    """Whether this shape may still be compiled (fewer than MAX_COMPILE_TRIES failures so far)."""
    return _compile_failures.get(model, {}).get(key, 0) < MAX_COMPILE_TRIES
