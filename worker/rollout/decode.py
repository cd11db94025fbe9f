"""Batched token sampling for rollouts: a hand-written decode loop over a KV cache.

Why not transformers' generate(): with an unmerged LoRA every adapted linear
costs three matmuls and PEFT's Python per token, and generate() adds logits
processors, stopping criteria, cache re-allocation and torch.multinomial
around each step. Here, one module a job:

- worker/rollout/effective_weights.py: the model to decode with (LoRA
  applied unmerged, cast to the rollout dtype once per rollout);
- worker/rollout/token_picking.py: each step's tokens from the logits
  (inverse-CDF sampling from per-row seeded streams, the spec's knobs,
  recorded log-probs, refusing NaN logits);
- this module: the loop itself on a CPU (and wherever compiling fails);
  only the last position goes through the LM head; each distinct prompt is
  prefilled once (a group's completions share it) into a cache grown in place
  (worker/rollout/growing_cache.py) from which finished rows are dropped, so
  a long-tailed batch stops paying for its short completions;
- worker/rollout/static_decode.py: the compiled loop (CUDA): a static cache
  and one CUDA-graphed step, with a fallback per shape;
- worker/rollout/rollout_state.py: freeing what rollouts keep before an update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.job_spec.sampling import SamplingSpec
from worker.model.cache_arg import CACHE_ARG
from worker.model.head_input import contiguous_head_input
from worker.rollout import static_decode
from worker.rollout.growing_cache import growing_cache
from worker.rollout.token_picking import FiniteGuard, Picker

__all__ = ["sample_tokens", "left_padded", "eager_loop"]

EAGER_CHECK_EVERY = 8  # CUDA: steps between the eager loop's syncs (dropping finished rows)


def left_padded(prompts: list[list[int]], max_new: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(ids, attention mask, positions), each (B, P + max_new), prompts left-padded so that every row's next
    token lands in the same column (P: the longest prompt)."""
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.full((B, P + max_new), pad_id, dtype=torch.long)
    mask = torch.ones((B, P + max_new), dtype=torch.long)
    # Whole blocks from nested lists: one tensor each, not two small copies per row.
    ids[:, :P] = torch.tensor([[pad_id] * (P - len(prompt)) + prompt for prompt in prompts], dtype=torch.long)
    mask[:, :P] = torch.tensor([[0] * (P - len(prompt)) + [1] * len(prompt) for prompt in prompts], dtype=torch.long)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample_tokens(
    model,
    prompts: list[list[int]],
    *,
    max_new: int,
    sampling: SamplingSpec,
    greedy: bool,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    compiled: bool = False,
    logprobs: bool = False,
    seeds: list[int] | None = None,
) -> tuple[list[list[int]], list[list[float]] | None]:
    """New tokens for each prompt (up to and including the first EOS, at most max_new), and with `logprobs`
    each new token's log-prob (see Picker), else None.

    `seeds`: one per prompt, the seed of that row's sampling stream (None: seeds drawn from torch's global RNG).

    `model` is a causal LM (apply LoRA first with `rollout_weights`) in eval mode.
    """
    B, P = len(prompts), max(map(len, prompts))
    ids, mask, positions = (t.to(device) for t in left_padded(prompts, max_new, pad_id))
    pick = Picker(sampling, greedy, (B, max_new), device, record=logprobs, seeds=seeds, eos_id=eos_id)
    guarded = FiniteGuard(pick)
    key = static_decode.shape_key(B, P + max_new)
    if compiled and static_decode.compile_allowed(model, key):
        try:
            lengths = static_decode.static_loop(model, ids, mask, positions, P, max_new, guarded, eos_id,
                                                step=static_decode.compiled_step(model))
        except Exception as e:  # an unsupported model or backend, or a transient failure: this shape, this time
            static_decode.compile_failed(model, key, e)
            guarded.flag = None  # the eager run below redoes every step
            lengths = eager_loop(model, ids, mask, positions, P, max_new, guarded, eos_id)
    else:
        lengths = eager_loop(model, ids, mask, positions, P, max_new, guarded, eos_id)
    guarded.check()
    lengths = lengths.tolist()
    tokens = [row[:n] for row, n in zip(ids[:, P:].tolist(), lengths)]
    if pick.logprobs_BT is None:
        return tokens, None
    return tokens, [row[:n] for row, n in zip(pick.logprobs_BT.tolist(), lengths)]


def eager_loop(model, ids, mask, positions, P, max_new, pick: Picker, eos_id, *,
               check_every: int | None = None) -> Tensor:
    """Decode with a growing cache; rows that reach EOS leave the batch (and the cache) every `check_every` steps.

    Asking whether any row finished is a device sync: on CUDA (where this loop runs only when compiling
    failed) that is done every EAGER_CHECK_EVERY steps, finished rows riding along until then; on a CPU,
    where a sync costs nothing, at every step."""
    check_every = check_every or (EAGER_CHECK_EVERY if ids.is_cuda else 1)
    B = ids.shape[0]
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    cache = growing_cache(model.config, P + max_new)  # written in place: no per-step copy of the cache
    live = torch.arange(B, device=ids.device)  # batch rows still decoding, in cache order
    # A group's completions share one prompt: prefill each distinct prompt once, then give every row its copy.
    unique, row_of = torch.unique(ids[:, :P], dim=0, return_inverse=True)
    firsts = torch.full((unique.shape[0],), B, dtype=torch.long, device=ids.device).scatter_reduce(
        0, row_of, live, reduce="amin")
    with contiguous_head_input(model, float32=False):  # no copy of the head per prompt (float32: PEFT's rounding)
        logits = model(input_ids=ids[firsts, :P], attention_mask=mask[firsts, :P],
                       position_ids=positions[firsts, :P], **{CACHE_ARG: cache}, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    cache.batch_select_indices(row_of)  # (prefilled in torch.unique's order, not the rows')
    logits = logits[row_of]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    for t in range(max_new):
        token = pick(logits, ids[live, : P + t], live, t)
        ids[live, P + t] = token
        newly = (token == eos_id) & ~finished[live]  # a row riding along after its EOS keeps its length
        lengths[live] = torch.where(newly, t + 1, lengths[live])
        finished[live] = finished[live] | newly
        if t == max_new - 1:
            break
        if (t + 1) % check_every == 0:
            done = finished[live]
            if done.any():
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                live, token = live[keep], token[keep]
                cache.batch_select_indices(keep)
        end = P + t + 1
        logits = model(input_ids=token[:, None], attention_mask=mask[live, :end],
                       position_ids=positions[live, end - 1 : end],
                       **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    return lengths
