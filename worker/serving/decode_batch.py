"""The running decode batch of a serving worker: rows of many requests and adapters, one forward per step.

Rows join between steps and leave at once, so the batch is continuous:
- joining: the newcomers' prompts are prefilled together (left-padded to the
  longest of them, explicit position ids, each row routed through its own
  adapter: worker/multi/lora.py's SegmentRouter; the padding and the forward
  are worker/rollout/decode.py's and static_decode.py's), then their KV cache is
  merged into the running one: both are left-padded with zero columns to a
  common length and concatenated along the rows, and the attention mask
  is padded likewise, so a padded column is never attended to. A row's
  positions are its own (the count of its real tokens), so the rotary
  phases of its keys are what they are alone;
- every step feeds each row its last token in one forward over all rows;
  rows stay sorted by adapter (the router needs an adapter's rows
  contiguous): a join reorders the cache, a leave keeps the order;
- leaving: a row's cache rows are dropped before the next forward, and the
  left columns that no remaining row attends to any more are cut off;
- each row picks its token (token_picking.pick_tokens): greedy as argmax,
  else the request's logits processors (temperature, top_p) and inverse-CDF
  on one uniform number a step from the row's own seeded generator, so a seed gives the same draws whatever else is in the batch.
The caches' layers must be transformers' plain DynamicLayer (full
attention), which every served model family here uses.

`forwards` records, per forward, its rows' adapter names and the number of
input tokens per row: what a caller (and the tests) can see of the batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from service.job_spec.sampling import SamplingSpec
from worker.multi.lora import SegmentRouter
from worker.rollout.decode import left_padded
from worker.rollout.static_decode import decode_step
from worker.rollout.token_picking import logits_processors, pick_tokens


@dataclass(eq=False)
class Row:
    """One completion being decoded: its adapter (None: the base), prompt, budget and sampling."""

    adapter: str | None
    prompt: list[int]
    max_new: int
    temperature: float
    top_p: float
    seed: int | None
    owner: object = None  # whoever asked (the scheduler's request)
    index: int = 0  # the choice's index in its request
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.temperature != 0:
            seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator = torch.Generator().manual_seed(seed)


def _order(adapter: str | None) -> tuple[bool, str]:
    return adapter is not None, adapter or ""


class DecodeBatch:
    def __init__(self, model, router: SegmentRouter, *, pad_id: int, device: torch.device):
        self.model, self.router, self.pad_id, self.device = model, router, pad_id, device
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # (rows, cached columns), 1 where attended
        self.positions: torch.Tensor | None = None  # (rows,) each row's position of its next input
        self.logits: torch.Tensor | None = None  # (rows, vocab) each row's next-token logits
        self.forwards: list[tuple[list[str | None], int]] = []
        self._processors: dict[tuple[float, float], object] = {}  # (temperature, top_p) -> logits processors

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def join(self, rows: list[Row]) -> None:
        """Prefill `rows` in one forward and merge them into the running batch."""
        if not rows:
            return
        rows = sorted(rows, key=lambda r: _order(r.adapter))
        padded = left_padded([r.prompt for r in rows], 0, self.pad_id)  # the decode loop's, without room for tokens
        ids, mask, first_positions = (t.to(self.device) for t in padded)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(rows, ids, mask, first_positions, cache)
        positions = torch.tensor([len(r.prompt) for r in rows], device=self.device)
        if self.cache is None:
            self.rows, self.cache, self.mask, self.positions, self.logits = rows, cache, mask, positions, logits
            return
        old, new = self.mask.shape[1], mask.shape[1]
        common = max(old, new)
        for kept, joined in zip(self.cache.layers, cache.layers, strict=True):
            if type(kept) is not DynamicLayer or type(joined) is not DynamicLayer:
                raise TypeError(f"serving batches full-attention caches only, not {type(kept).__name__}")
            kept.keys = torch.cat([_left_pad(kept.keys, common), _left_pad(joined.keys, common)])
            kept.values = torch.cat([_left_pad(kept.values, common), _left_pad(joined.values, common)])
        self.mask = torch.cat([functional.pad(self.mask, (common - old, 0)), functional.pad(mask, (common - new, 0))])
        self.positions = torch.cat([self.positions, positions])
        self.logits = torch.cat([self.logits, logits])
        self.rows = self.rows + rows
        order = sorted(range(len(self.rows)), key=lambda i: _order(self.rows[i].adapter))
        if order != list(range(len(self.rows))):
            self._select(order)

    def pick(self) -> list[int]:
        """Each row's next token from its pending logits (appended to its tokens); rows whose logits are not
        finite get -1 (their request fails: sampling from NaN would silently give the last token id)."""
        scores = self.logits.float()
        finite = torch.isfinite(scores).all(-1).tolist()
        tokens = [-1] * len(self.rows)
        greedy = [i for i, r in enumerate(self.rows) if r.temperature == 0 and finite[i]]
        if greedy:
            for i, t in zip(greedy, scores[greedy].argmax(-1).tolist()):
                tokens[i] = t
        groups: dict[tuple[float, float], list[int]] = {}
        for i, r in enumerate(self.rows):
            if r.temperature != 0 and finite[i]:
                groups.setdefault((r.temperature, r.top_p), []).append(i)
        for knobs, members in groups.items():
            if (procs := self._processors.get(knobs)) is None:
                procs = self._processors[knobs] = logits_processors(
                    SamplingSpec(temperature=knobs[0], top_p=knobs[1]), greedy=False)
            uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=self.rows[i].generator)
                                 for i in members]).to(scores.device)
            history = torch.zeros((len(members), 0), dtype=torch.long, device=scores.device)  # no knob reads it
            for i, t in zip(members, pick_tokens(scores[members], history, procs, False, uniform).tolist()):
                tokens[i] = t
        for row, token in zip(self.rows, tokens):
            if token >= 0:
                row.tokens.append(token)
        return tokens

    def drop(self, rows: set[Row]) -> None:
        """Take `rows` out of the batch now (finished, or their caller gone)."""
        if not rows:
            return
        keep = [i for i, r in enumerate(self.rows) if r not in rows]
        if not keep:
            self.rows, self.cache, self.mask, self.positions, self.logits = [], None, None, None, None
            return
        self._select(keep)
        attended = self.mask.any(0).nonzero()
        first = int(attended[0]) if attended.numel() else 0
        if first > 0:  # columns no remaining row attends to: padding of rows that left
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]

    @torch.no_grad()
    def advance(self, tokens: list[int]) -> None:
        """One forward over every row, each fed its last token (`tokens`, in row order)."""
        if not self.rows:
            return
        ids = torch.tensor(tokens, device=self.device)[:, None]
        self.mask = functional.pad(self.mask, (0, 1), value=1)
        self.logits = self._forward(self.rows, ids, self.mask, self.positions[:, None], self.cache)
        self.positions = self.positions + 1

    def _forward(self, rows: list[Row], ids_BT, mask_BL, positions_BT, cache) -> torch.Tensor:
        names = [r.adapter for r in rows]
        self.forwards.append((names, ids_BT.shape[1]))
        with self.router.rows(names):
            return decode_step(self.model, ids_BT, mask_BL, positions_BT, cache)

    def _select(self, indices: list[int]) -> None:
        index = torch.tensor(indices, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask, self.positions, self.logits = self.mask[index], self.positions[index], self.logits[index]
        self.rows = [self.rows[i] for i in indices]


def _left_pad(states: torch.Tensor, length: int) -> torch.Tensor:
    """(rows, heads, columns, dim) states with zero columns put before them, up to `length` columns."""
    return functional.pad(states, (0, 0, length - states.shape[2], 0))
