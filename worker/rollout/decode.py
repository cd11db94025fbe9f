"""Batched token sampling: one hand-written decode loop over a KV cache, for one job's rows or several jobs'.

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
- worker/rollout/rollout_state.py: freeing what rollouts keep before an update;
- worker/serving/decode_batch.py: the serving worker's batch, where requests
  join between steps, on the same padding (`left_padded`) and forward
  (static_decode.decode_step) as the loops here.

The loop decodes groups of rows (`JobRows`), one per job: one job alone
(`sample_tokens`) is one group on a model that is the same for every row;
several jobs over a shared base (`sample_jobs`: worker/multi, worker/engine)
are groups sorted by job, every forward routed so that each row goes through
its own job's adapter (worker/multi/lora.py's SegmentRouter; a job named
None: the base alone), one pass over the base weights a step serving every
job. What a row samples depends on its own job only:
- each job has its own picker: its sampling knobs, its per-row uniform
  streams drawn up front for exactly the (rows, max_new) shape the job would
  use alone, its recorded log-probs at its own temperature, its
  min_output_tokens; a row's token history (repetition penalty) is cut to its
  job's own left-padded width, as alone;
- a distinct prompt is prefilled once per job (two jobs with one prompt have
  different adapters, so they never share a prefill);
- a job's rows stop at its own max_new, at EOS or one of its own stop tokens,
  or once its own `ends` says so (stop strings: a check of the row's new
  tokens after each step, on the CPU); NaN or inf logits fail that job only;
- a job that asks for prompt log-probs gets them from the prefill (the
  decoder's output taken by a hook, the LM head run on its prompt positions
  only), not from a second forward.
Asking whether rows finished is a device sync: on CUDA it is done every
EAGER_CHECK_EVERY steps (and when a job reaches its max_new), finished rows
riding along until then; on a CPU, where a sync costs nothing, every step.
The numbers of a row can still differ from its job decoded alone in float
rounding (the batch is padded to the longest prompt of all jobs, and a kernel
may sum in another order for another batch shape); the tests bound that.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from service.job_spec.sampling import SamplingSpec
from worker.cispo import token_logprobs
from worker.model.head_input import contiguous_head_input, decoder_outputs
from worker.rollout import static_decode
from worker.rollout.growing_cache import growing_cache
from worker.rollout.static_decode import decode_step
from worker.rollout.token_picking import FiniteGuard, NonFiniteLogits, Picker

if TYPE_CHECKING:
    from worker.multi.lora import SegmentRouter

__all__ = ["JobRows", "sample_tokens", "sample_jobs", "left_padded", "EAGER_CHECK_EVERY"]

EAGER_CHECK_EVERY = 8  # CUDA: steps between the eager loop's syncs (dropping finished rows)


@dataclass
class JobRows:
    """One job's share of a decode call."""

    name: str | None  # the job's adapter on the shared base (None: the base alone, or the model as it is)
    prompts: list[list[int]]
    max_new: int
    sampling: SamplingSpec
    greedy: bool = False
    seeds: list[int] | None = None  # one per prompt (None: drawn from torch's global RNG; unused when greedy)
    logprobs: bool = False
    stop_tokens: tuple[int, ...] = ()  # ids that end a row as EOS does (kept, as EOS is)
    ends: Callable[[list[int]], bool] | None = None  # whether a row's new tokens so far end it (stop strings)
    prompt_logprobs: bool = False  # per prompt: [None] + log p(prompt[t] | prompt[:t]) for t >= 1, temperature 1


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
    each new token's log-prob (see Picker), else None; NonFiniteLogits if any logits held NaN or inf.

    `seeds`: one per prompt, the seed of that row's sampling stream (None: seeds drawn from torch's global RNG).
    `compiled`: the compiled loop (worker/rollout/static_decode.py) where this shape may still compile.

    `model` is a causal LM (apply LoRA first with `rollout_weights`) in eval mode.
    """
    batch = _Batch([JobRows(None, prompts, max_new, sampling, greedy=greedy, seeds=seeds, logprobs=logprobs)],
                   eos_id=eos_id, pad_id=pad_id, device=device)
    if not (compiled and _static(model, batch, eos_id)):
        _decode(model, None, batch)
    (result,) = batch.results()
    if isinstance(result, NonFiniteLogits):
        raise result
    return result


@torch.no_grad()
def sample_jobs(model, router: SegmentRouter | None, jobs: list[JobRows], *, eos_id: int | list[int], pad_id: int,
                device: torch.device, check_every: int | None = None) -> list[tuple | NonFiniteLogits]:
    """Per job, in order: (new tokens per prompt, up to and including EOS or the token that ended it, at most its
    max_new; log-probs or None), as sample_tokens returns for that job alone, with a third element, the prompt
    log-probs per prompt, for a job that asks for them; or NonFiniteLogits for a job whose rows gave NaN or inf
    logits (rows never mix, so the other jobs' rows are unaffected).

    `model` is the shared PeftModel in eval mode, its rows routed by `router` (or the bare base where every job is
    named None; or any model with router None: every row through the model as it is); `eos_id`: one id or
    several. Jobs with one name must be given next to each other (the router needs an adapter's rows
    contiguous). `check_every`: steps between drops of finished rows (None: EAGER_CHECK_EVERY on CUDA, else 1)."""
    if not any(job.prompts for job in jobs):
        return [([], None) for _ in jobs]
    batch = _Batch(jobs, eos_id=eos_id, pad_id=pad_id, device=device)
    _decode(model, router, batch, check_every=check_every)
    return batch.results()


class _Batch:
    """The jobs' rows in one left-padded batch, in the jobs' order; per job its picker (wrapped in a FiniteGuard:
    one device flag for NaN logits), stop ids and rows; what the decode fills in (lengths, prompt log-probs)."""

    def __init__(self, jobs: list[JobRows], *, eos_id: int | list[int], pad_id: int, device: torch.device):
        self.jobs, self.names = jobs, [job.name for job in jobs]
        self.prompts = [p for job in jobs for p in job.prompts]
        self.max_new, self.P = max(job.max_new for job in jobs), max(map(len, self.prompts))
        self.ids, self.mask, self.positions = (t.to(device) for t in left_padded(self.prompts, self.max_new, pad_id))
        self.job_of = [j for j, job in enumerate(jobs) for _ in job.prompts]  # each row's job (on the CPU)
        self.starts = [sum(len(job.prompts) for job in jobs[:j]) for j in range(len(jobs))]  # each job's first row
        self.widths = [max(map(len, job.prompts), default=0) for job in jobs]  # each job's own left-padded width
        self.guards = [FiniteGuard(Picker(job.sampling, job.greedy, (len(job.prompts), job.max_new), device,
                                          record=job.logprobs, seeds=job.seeds, eos_id=eos_id)) for job in jobs]
        eos_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        self.stop_ids = [torch.tensor(sorted({*eos_ids, *job.stop_tokens}), dtype=torch.long, device=device)
                         for job in jobs]
        self.lengths = torch.tensor([job.max_new for job in jobs for _ in job.prompts], device=device)
        self.prompt_logprobs: dict[int, list] = {}  # per row of a job that asks for them

    def results(self) -> list[tuple | NonFiniteLogits]:
        lengths, new = self.lengths.tolist(), self.ids[:, self.P :].tolist()
        out = []
        for job, guard, start in zip(self.jobs, self.guards, self.starts):
            if (error := guard.error()) is not None:
                out.append(error)
                continue
            rows = range(start, start + len(job.prompts))
            tokens = [new[r][: lengths[r]] for r in rows]
            logps = guard.pick.logprobs_BT
            logps = None if logps is None else [lp[: lengths[r]] for lp, r in zip(logps.tolist(), rows)]
            out.append((tokens, logps, [self.prompt_logprobs[r] for r in rows]) if job.prompt_logprobs
                       else (tokens, logps))
        return out


def _static(model, batch: _Batch, eos_id: int) -> bool:
    """Whether the compiled loop decoded the batch (one job's): False where this shape may not compile any more,
    or compiling it failed this time (then the eager loop redoes every step, with the same picker)."""
    key = static_decode.shape_key(batch.ids.shape[0], batch.P + batch.max_new)
    if not static_decode.compile_allowed(model, key):
        return False
    guarded = batch.guards[0]
    try:
        batch.lengths = static_decode.static_loop(model, batch.ids, batch.mask, batch.positions, batch.P,
                                                  batch.max_new, guarded, eos_id,
                                                  step=static_decode.compiled_step(model))
    except Exception as e:  # an unsupported model or backend, or a transient failure: this shape, this time
        static_decode.compile_failed(model, key, e)
        guarded.flag = None
        return False
    return True


class _Unrouted:
    """The router of a model that is the same for every row."""

    @staticmethod
    def rows(names: list[str | None]):
        return nullcontext()


def _decode(model, router: SegmentRouter | None, batch: _Batch, *, check_every: int | None = None) -> None:
    """Decode the batch with a growing cache into batch.ids (batch.lengths: each row's number of new tokens);
    finished rows leave the batch (and the cache) every `check_every` steps."""
    router = router or _Unrouted()
    ids, mask, positions, P, max_new, jobs = batch.ids, batch.mask, batch.positions, batch.P, batch.max_new, batch.jobs
    check_every = check_every or (EAGER_CHECK_EVERY if ids.is_cuda else 1)
    device, B = ids.device, ids.shape[0]
    cache = growing_cache(model.config, P + max_new)  # written in place: no per-step copy of the cache
    logits = _prefill(model, router, batch, cache)
    lengths, finished = batch.lengths, torch.zeros(B, dtype=torch.bool, device=device)
    live = torch.arange(B, device=device)  # batch rows still decoding, in cache order
    live_jobs = batch.job_of  # their jobs (on the CPU): contiguous segments, in the jobs' order
    segments, names = _segments(live_jobs), [batch.names[j] for j in live_jobs]
    for t in range(max_new):
        picked, stops = [], []
        for j, s, e in segments:
            rows = live[s:e]
            pick = batch.guards[j]  # (rows of their own job: its index of a row is the row's offset in the job)
            picked.append(pick(logits[s:e], ids[rows, P - batch.widths[j] : P + t], rows - batch.starts[j], t))
            stops.append(torch.isin(picked[-1], batch.stop_ids[j]))
        token, stopped = _joined(picked), _joined(stops)
        ids[live, P + t] = token
        for j, s, e in segments:  # stop strings: the new tokens of each row not finished yet, on the CPU
            if (ends := jobs[j].ends) is not None:
                running = (~finished[live[s:e]]).tolist()
                new = ids[live[s:e], P : P + t + 1].tolist()
                stopped[s:e] |= torch.tensor([r and ends(n) for r, n in zip(running, new)], device=device)
        newly = stopped & ~finished[live]  # a row riding along after its end keeps its length
        lengths[live] = torch.where(newly, t + 1, lengths[live])
        finished[live] = finished[live] | newly
        if t == max_new - 1:
            break
        at_max = [jobs[j].max_new == t + 1 for j, _, _ in segments]  # a job's rows done: known without a sync
        if (t + 1) % check_every == 0 or any(at_max):
            done = finished[live]
            if any(at_max):
                done = done | torch.tensor([m for m, (_, s, e) in zip(at_max, segments) for _ in range(s, e)],
                                           device=device)
            if done.any():
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                live, token = live[keep], token[keep]
                cache.batch_select_indices(keep)
                live_jobs = [live_jobs[k] for k in keep.tolist()]
                segments, names = _segments(live_jobs), [batch.names[j] for j in live_jobs]
        end = P + t + 1
        with router.rows(names):
            logits = decode_step(model, token[:, None], mask[live, :end], positions[live, end - 1 : end], cache)


def _prefill(model, router, batch: _Batch, cache) -> Tensor:
    """Each row's first logits, `cache` then holding every row's prompt: each distinct (job, prompt) prefilled once
    (a group's completions share one), each row given its copy; torch.unique sorts by the job column first, so
    the prefilled rows stay sorted by job. Fills batch.prompt_logprobs for the jobs that ask for them."""
    ids, mask, positions, P, B = batch.ids, batch.mask, batch.positions, batch.P, batch.ids.shape[0]
    job_of = torch.tensor(batch.job_of, device=ids.device)
    unique, row_of = torch.unique(torch.cat([job_of[:, None], ids[:, :P]], dim=1), dim=0, return_inverse=True)
    firsts = torch.full((unique.shape[0],), B, dtype=torch.long, device=ids.device).scatter_reduce(
        0, row_of, torch.arange(B, device=ids.device), reduce="amin")
    scored = [b for b, j in enumerate(batch.job_of) if batch.jobs[j].prompt_logprobs]
    # no copy of the head per prompt (float32 heads as they are: PEFT's rounding)
    with router.rows([batch.names[j] for j in job_of[firsts].tolist()]), \
            contiguous_head_input(model, float32=False), \
            (decoder_outputs(model) if scored else nullcontext()) as hidden:
        logits = decode_step(model, ids[firsts, :P], mask[firsts, :P], positions[firsts, :P], cache)
    if scored:
        batch.prompt_logprobs = _prompt_logprobs(model, hidden[-1], ids, row_of, batch.prompts, P, scored)
    cache.batch_select_indices(row_of)  # (prefilled in torch.unique's order, not the rows')
    return logits[row_of]


def _segments(jobs_per_row: list[int]) -> list[tuple[int, int, int]]:
    """[(job, start, end)] of the consecutive rows of each job (rows sorted by job)."""
    segments, start = [], 0
    for j, run in groupby(jobs_per_row):
        end = start + sum(1 for _ in run)
        segments.append((j, start, end))
        start = end
    return segments


def _joined(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prompt_logprobs(model, hidden_UPH, ids, row_of, prompts, P: int, rows: list[int]) -> dict[int, list]:
    """Per given row: [None] + log p(prompt[t] | prompt[:t]) at temperature 1, from its prefilled prompt's decoder
    output (index row_of[row] of the prefill), the LM head run on that prompt's positions only (left-padded: the
    prompt ends at P); rows sharing a prefill share the list."""
    head = model.get_output_embeddings()
    by_prefill: dict[int, list] = {}
    out: dict[int, list] = {}
    for b in rows:
        u, n = int(row_of[b]), len(prompts[b])
        if u not in by_prefill:
            logp = [] if n < 2 else token_logprobs(head, hidden_UPH[u : u + 1, P - n : P - 1],
                                                   ids[b : b + 1, P - n + 1 : P], temperature=1.0)[0][0].tolist()
            by_prefill[u] = [None, *logp]
        out[b] = by_prefill[u]
    return out
