"""Choosing each decode step's tokens from the logits, by the job's sampling spec.

- sampling is inverse-CDF (one uniform number per row), which draws token i
  with probability p_i like torch.multinomial at a fraction of its cost;
  each row's uniforms come from its own seeded stream (`seeds`, see
  worker/model/streams.py), so a row samples the same tokens whatever else
  shares its batch (its group's other completions, other prompts, other ranks);
- the sampling knobs reuse transformers' own logits processors, built from the
  job's SamplingSpec alone (a model's generation_config never overrides the spec);
- logits that hold NaN or inf (an overflow, diverged weights) fail the
  rollout with NonFiniteLogits: sampling from them would silently pick the
  last token id.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from service.job_spec.sampling import SamplingSpec

__all__ = ["Picker", "FiniteGuard", "NonFiniteLogits", "logits_processors", "pick_tokens"]


class NonFiniteLogits(RuntimeError):
    """The model gave NaN or inf logits while sampling."""


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


def pick_tokens(logits_BV: Tensor, history_BT: Tensor, procs: LogitsProcessorList, greedy: bool,
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


class Picker:
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
        self.uniforms_BT = None if greedy else row_uniforms(seeds, shape, device)

    def __call__(self, logits_BV: Tensor, history_BT: Tensor, rows: Tensor | slice, t: int) -> Tensor:
        uniform_B = None if self.uniforms_BT is None else self.uniforms_BT[rows, t]
        scores_BV = logits_BV
        if t < self.min_tokens:
            scores_BV = logits_BV.clone()
            scores_BV[:, self.eos_id] = float("-inf")
        token_B = pick_tokens(scores_BV, history_BT, self.procs, self.greedy, uniform_B)
        if self.logprobs_BT is not None:
            logp_BV = torch.log_softmax(logits_BV.float() / self.temperature, dim=-1)
            self.logprobs_BT[rows, t] = logp_BV.gather(1, token_B[:, None]).squeeze(1)
        return token_B


def row_uniforms(seeds: list[int] | None, shape: tuple[int, int], device) -> Tensor:
    """(B, T) uniform numbers, row i from a generator seeded with seeds[i] (None: seeds from torch's global RNG).

    Drawn up front on the CPU (one generator per row, not one call per row and step) and moved once."""
    rows, steps = shape
    if seeds is None:
        seeds = torch.randint(0, 2**62, (rows,)).tolist()
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} sampling seeds for {rows} rows")
    uniforms = [torch.rand(steps, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.stack(uniforms).to(device) if uniforms else torch.zeros(shape, dtype=torch.float64, device=device)


class FiniteGuard:
    """A picker that also notes whether any logits it saw held NaN or inf, in one device flag read once at the
    end (no sync per step). Sampling from such logits would silently give the last token id."""

    def __init__(self, pick: Picker):
        self.pick, self.flag = pick, None

    def __call__(self, logits_BV: Tensor, *args) -> Tensor:
        bad = ~torch.isfinite(logits_BV).all()
        self.flag = bad if self.flag is None else self.flag | bad
        return self.pick(logits_BV, *args)

    def error(self) -> NonFiniteLogits | None:
        """What fails the rollout if any logits held NaN or inf (the flag's one read), else None."""
        if self.flag is not None and bool(self.flag):
            return NonFiniteLogits(
                "the model gave NaN or inf logits while sampling (an overflow, e.g. float16 activations, or "
                "weights that diverged); the rollout is refused rather than sampled from them")
        return None
