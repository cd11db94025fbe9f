"""A Draw as rows of the shared decode (worker/rollout/decode.py's JobRows), and its sequences back out.

What Tinker's SamplingParams mean here:
- temperature 0 is greedy (argmax); the recorded log-probs are then the model's own (temperature 1), since the
  limit of softmax(logits / T) as T -> 0 would give every picked token log-prob 0;
- at any other temperature a token's log-prob is log softmax(logits / T)[token], the distribution sampled from
  before top-k / top-p truncation (worker/rollout/token_picking.py's Picker): at T = 1 exactly what
  forward_backward scores for the same tokens (the cookbook's kl_sample_train ~ 0); at T != 1 it is the
  tempered policy, so an importance ratio p_train / p_sampler weighs the tempered sampling correctly (the
  cookbook warns that T != 1 does not mix with its KL penalty, which scores the reference at T = 1);
- top_k -1 is off; seed: each sample i of the draw samples from its own stream, stream_seed("draw", seed, i),
  so one seed gives the same tokens whatever else shares the decode (None: fresh seeds from torch's RNG);
- stop: ints are token ids that end a sequence as EOS does; strings end it once the decoded new text contains
  one (the sequence keeps the token that completed it); EOS always ends a sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from service.job_spec.sampling import SamplingSpec
from worker.engine.types import Draw, Sequence
from worker.model.streams import stream_seed
from worker.rollout.decode import JobRows


def job_rows(draw: Draw, name: str | None, tokenizer, *, where: str) -> JobRows:
    """The draw's num_samples rows, through adapter `name` (None: the base alone); `where` names the draw in
    errors. Raises ValueError for a draw that cannot be served."""
    p = draw.params
    if not draw.prompt:
        raise ValueError(f"{where}: the prompt is empty")
    if draw.num_samples < 1 or p.max_tokens < 1:
        raise ValueError(f"{where}: num_samples ({draw.num_samples}) and max_tokens ({p.max_tokens}) must be >= 1")
    if p.temperature < 0 or p.top_k < -1 or p.top_k == 0:
        raise ValueError(f"{where}: temperature must be >= 0 (0: greedy) and top_k -1 (off) or >= 1")
    ids = tuple(s for s in p.stop if isinstance(s, int))
    strings = [s for s in p.stop if isinstance(s, str)]
    if len(ids) + len(strings) != len(p.stop):
        raise ValueError(f"{where}: stop holds token ids (ints) and strings only")
    if strings and tokenizer is None:
        raise ValueError(f"{where}: stop strings need the base's tokenizer, and the engine has none")
    greedy = p.temperature == 0
    try:
        sampling = SamplingSpec(temperature=1.0 if greedy else p.temperature, top_p=p.top_p,
                                top_k=max(p.top_k, 0))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    seeds = None if greedy or p.seed is None else [stream_seed("draw", p.seed, i) for i in range(draw.num_samples)]
    return JobRows(name, [list(draw.prompt)] * draw.num_samples, p.max_tokens, sampling, greedy=greedy,
                   seeds=seeds, logprobs=True, stop_tokens=ids, ends=stop_strings(tokenizer, strings),
                   prompt_logprobs=draw.prompt_logprobs)


def stop_strings(tokenizer, strings: list[str]) -> Callable[[list[int]], bool] | None:
    """Whether new tokens' decoded text holds one of `strings` (None without strings). The whole new text is
    decoded each time: a token's text can depend on its neighbours (byte pieces of one character)."""
    if not strings:
        return None

    def ends(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens)
        return any(s in text for s in strings)

    return ends


def sequences(rows: JobRows, tokens: list[list[int]], logprobs: list[list[float]],
              eos_ids: list[int]) -> list[Sequence]:
    """The decoded rows as Sequences; "stop" where EOS, a stop token or a stop string ended a row, else "length"
    (a row ends at the first of them, so that one is its last token)."""
    stops = {*eos_ids, *rows.stop_tokens}

    def reason(new: list[int]) -> str:
        ended = bool(new) and (new[-1] in stops or (rows.ends is not None and rows.ends(new)))
        return "stop" if ended else "length"

    return [Sequence(t, lp, reason(t)) for t, lp in zip(tokens, logprobs, strict=True)]
