"""Token-by-token decoding for serving, and text deltas that never cut a stop sequence or a character in two.

The trainer's loop (worker/rollout/decode.py) samples whole batches and
returns when every row is done; a streamed reply needs each token as soon as
it exists. This loop decodes one sequence over a KV cache with the same
sampling rule: the same logits processors, greedy as argmax, otherwise
inverse-CDF on a uniform number from the request's seeded stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import DynamicCache

from service.job_spec.sampling import SamplingSpec
from worker.model.cache_arg import CACHE_ARG
from worker.rollout.token_picking import NonFiniteLogits, logits_processors


@torch.no_grad()
def stream_tokens(model, prompt: list[int], *, max_new: int, temperature: float, top_p: float, seed: int | None,
                  eos_id: int, device: torch.device) -> Iterator[int]:
    """Each new token as it is sampled, EOS included (then it stops); at most max_new. temperature 0: greedy."""
    greedy = temperature == 0
    spec = SamplingSpec(temperature=temperature if not greedy else 1.0, top_p=top_p)
    procs = logits_processors(spec, greedy=greedy)
    generator = None if greedy else torch.Generator().manual_seed(
        seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    history = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = DynamicCache()
    logits = model(input_ids=history, use_cache=True, **{CACHE_ARG: cache}).logits[:, -1, :]
    for _ in range(max_new):
        scores = logits.float()
        if not torch.isfinite(scores).all():
            raise NonFiniteLogits("the model gave NaN or inf logits")
        scores = procs(history, scores) if procs else scores
        if greedy:
            token = scores.argmax(-1)
        else:
            cdf = torch.softmax(scores, dim=-1).double().cumsum(-1)
            u = torch.rand(1, dtype=torch.float64, generator=generator).to(cdf.device) * cdf[:, -1]
            token = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
        yield int(token.item())
        if int(token.item()) == eos_id:
            return
        history = torch.cat([history, token[:, None]], dim=1)
        logits = model(input_ids=token[:, None], use_cache=True, **{CACHE_ARG: cache}).logits[:, -1, :]


class TextDeltas:
    """Turns token ids into the text to send next: held back while it may still grow into a stop sequence,
    or ends in half a multi-byte character; cut before the first stop sequence, which is never sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        ready = len(text.rstrip("\ufffd"))  # a character still arriving byte by byte
        for s in self.stops:  # a tail that could be the start of a stop sequence waits for the next token
            for k in range(min(len(s) - 1, ready), 0, -1):
                if text[:ready].endswith(s[:k]):
                    ready = min(ready, len(text[:ready]) - k)
                    break
        return self._release(text, ready)

    def flush(self) -> str:
        """What is left once decoding ended without a stop sequence."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        out = text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
