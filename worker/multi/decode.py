"""One decode loop for several jobs' rows over the shared base, each row through its own job's adapter.

worker/rollout/decode.py's eager loop, generalised to rows of several jobs:
the rows are sorted by job and every forward is routed (worker/multi/lora.py),
so one pass over the base weights per decode step serves every job. What a row
samples depends on its own job only:
- each job has its own picker (worker/rollout/token_picking.py's `Picker`): its
  sampling knobs, its per-row uniform streams drawn up front for exactly the
  (rows, max_new) shape the job would use alone, its recorded log-probs at its
  own temperature, its min_output_tokens;
- a row's token history (repetition penalty) is cut to its job's own
  left-padded width, as alone;
- a distinct prompt is prefilled once per job (two jobs with one prompt have
  different adapters, so they never share a prefill);
- a job's rows stop at its own max_new, at EOS or one of its own stop tokens,
  or once its own `ends` says so (stop strings: a check of the row's new
  tokens after each step, on the CPU); finished rows leave the batch and the
  cache at every step (CPU: a sync costs nothing), which keeps rows sorted;
- a job named None samples from the base alone (lora.py's BASE_ONLY rows);
- a job that asks for prompt log-probs gets them from the prefill it shares
  with the others (the decoder's output taken by a hook, the LM head run on
  its prompt positions only), not from a second forward.
The numbers of a row can still differ from its job decoded alone in float
rounding (the batch is padded to the longest prompt of all jobs, and a kernel
may sum in another order for another batch shape); the tests bound that.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from service.job_spec.sampling import SamplingSpec
from worker.cispo import token_logprobs
from worker.multi.lora import SegmentRouter
from worker.model.cache_arg import CACHE_ARG
from worker.rollout.decode import left_padded
from worker.rollout.growing_cache import growing_cache
from worker.rollout.token_picking import NonFiniteLogits, Picker
from worker.model.head_input import decoder_outputs


@dataclass
class JobRows:
    """One job's share of a shared decode call."""

    name: str | None  # the job's adapter on the shared base (None: the base alone)
    prompts: list[list[int]]
    max_new: int
    sampling: SamplingSpec
    greedy: bool = False
    seeds: list[int] | None = None  # one per prompt (None: greedy)
    logprobs: bool = False
    stop_tokens: tuple[int, ...] = ()  # ids that end a row as EOS does (kept, as EOS is)
    ends: Callable[[list[int]], bool] | None = None  # whether a row's new tokens so far end it (stop strings)
    prompt_logprobs: bool = False  # per prompt: [None] + log p(prompt[t] | prompt[:t]) for t >= 1, temperature 1


@torch.no_grad()
def sample_jobs(model, router: SegmentRouter, jobs: list[JobRows], *, eos_id: int | list[int], pad_id: int,
                device: torch.device) -> list[tuple | NonFiniteLogits]:
    """Per job, in order: (new tokens per prompt, up to and including EOS or the token that ended it, at most its
    max_new; log-probs or None), as worker/rollout/decode.sample_tokens returns for that job alone, with a third
    element, the prompt log-probs per prompt, for a job that asks for them; or NonFiniteLogits for a job whose
    rows gave NaN or inf logits (rows never mix, so the other jobs' rows are unaffected). `model` is the shared
    PeftModel in eval mode (or the bare base where every job is named None); `eos_id`: one id or several. Jobs
    with one name must be given next to each other (the router needs an adapter's rows contiguous)."""
    prompts = [p for job in jobs for p in job.prompts]
    if not prompts:
        return [([], None) for _ in jobs]
    max_new = max(job.max_new for job in jobs)
    B, P = len(prompts), max(map(len, prompts))
    ids, mask, positions = (t.to(device) for t in left_padded(prompts, max_new, pad_id))
    job_of = torch.tensor([j for j, job in enumerate(jobs) for _ in job.prompts], device=device)
    local = torch.tensor([i for job in jobs for i in range(len(job.prompts))], device=device)
    widths = [max(map(len, job.prompts), default=0) for job in jobs]  # each job's own left-padded width
    pickers = [Picker(job.sampling, job.greedy, (len(job.prompts), job.max_new), device, record=job.logprobs,
                       seeds=job.seeds, eos_id=eos_id) for job in jobs]
    lengths = torch.tensor([job.max_new for job in jobs for _ in job.prompts], device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    names = [job.name for job in jobs]
    eos_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    stop_ids = [torch.tensor(sorted({*eos_ids, *job.stop_tokens}), dtype=torch.long, device=device) for job in jobs]
    scored = any(job.prompt_logprobs for job in jobs)

    # Prefill each (job, prompt) once; torch.unique sorts by the job column first, so rows stay sorted by job.
    keyed = torch.cat([job_of[:, None], ids[:, :P]], dim=1)
    unique, row_of = torch.unique(keyed, dim=0, return_inverse=True)
    firsts = torch.full((unique.shape[0],), B, dtype=torch.long, device=device).scatter_reduce(
        0, row_of, torch.arange(B, device=device), reduce="amin")
    cache = growing_cache(model.config, P + max_new)
    with router.rows([names[j] for j in job_of[firsts].tolist()]), \
            (decoder_outputs(model) if scored else nullcontext()) as hidden:
        logits = model(input_ids=ids[firsts, :P], attention_mask=mask[firsts, :P],
                       position_ids=positions[firsts, :P], **{CACHE_ARG: cache}, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    scored_rows = [b for b, j in enumerate(job_of.tolist()) if jobs[j].prompt_logprobs]
    prompt_logps = _prompt_logprobs(model, hidden[-1], ids, row_of, prompts, P, scored_rows) if scored else {}
    cache.batch_select_indices(row_of)
    logits = logits[row_of]
    live = torch.arange(B, device=device)
    bad = [False] * len(jobs)
    for t in range(max_new):
        finite = torch.isfinite(logits).all(-1)
        token = torch.empty(live.shape[0], dtype=torch.long, device=device)
        stopped = torch.zeros(live.shape[0], dtype=torch.bool, device=device)
        live_jobs = job_of[live]
        for j, pick in enumerate(pickers):
            sel = (live_jobs == j).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            rows = live[sel]
            bad[j] = bad[j] or not bool(finite[sel].all())
            history = ids[rows, P - widths[j] : P + t]
            token[sel] = pick(logits[sel], history, local[rows], t)
            stopped[sel] = torch.isin(token[sel], stop_ids[j])
        ids[live, P + t] = token
        for j, job in enumerate(jobs):
            if job.ends is not None:
                for k in (live_jobs == j).nonzero().squeeze(1).tolist():
                    stopped[k] |= job.ends(ids[live[k], P : P + t + 1].tolist())
        newly = stopped & ~finished[live]
        lengths[live] = torch.where(newly, t + 1, lengths[live])
        finished[live] = finished[live] | newly | (lengths[live] == t + 1)  # EOS, or the job's max_new reached
        keep = (~finished[live]).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        if keep.numel() < live.numel():
            live, token = live[keep], token[keep]
            cache.batch_select_indices(keep)
        end = P + t + 1
        with router.rows([names[j] for j in job_of[live].tolist()]):
            logits = model(input_ids=token[:, None], attention_mask=mask[live, :end],
                           position_ids=positions[live, end - 1 : end], **{CACHE_ARG: cache}, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
    out = []
    for j, (job, pick) in enumerate(zip(jobs, pickers)):
        if bad[j]:
            out.append(NonFiniteLogits(
                "the model gave NaN or inf logits while sampling (an overflow, or weights that diverged); the "
                "rollout is refused rather than sampled from them"))
            continue
        rows = (job_of == j).nonzero().squeeze(1).tolist()
        tokens = [ids[r, P : P + int(lengths[r])].tolist() for r in rows]
        logps = None if pick.logprobs_BT is None else [
            pick.logprobs_BT[i, : int(lengths[r])].tolist() for i, r in enumerate(rows)]
        if job.prompt_logprobs:
            out.append((tokens, logps, [prompt_logps[int(row_of[r])] for r in rows]))
        else:
            out.append((tokens, logps))
    return out


def _prompt_logprobs(model, hidden_UPH, ids, row_of, prompts, P: int, rows: list[int]) -> dict[int, list]:
    """Per prefilled prompt (its index in the prefill) of the given rows: [None] + log p(prompt[t] | prompt[:t])
    at temperature 1, the LM head run on that prompt's positions only (left-padded: the prompt ends at P)."""
    head = model.get_output_embeddings()
    out: dict[int, list] = {}
    for b in rows:
        u, n = int(row_of[b]), len(prompts[b])
        if u in out:
            continue
        logp = [] if n < 2 else token_logprobs(head, hidden_UPH[u : u + 1, P - n : P - 1],
                                               ids[b : b + 1, P - n + 1 : P], temperature=1.0)[0][0].tolist()
        out[u] = [None, *logp]
    return out

