"""Scoring rows of many adapters in one forward over the shared base: collate, route, per-token log-probs.

The pieces every batched training forward is built from (the resident jobs' update, worker/multi/update.py, and
the engine's forward_backward): rows are given with the name of the adapter each goes through, sorted so an
adapter's rows are contiguous (worker/multi/lora.py's SegmentRouter).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from worker.cispo import token_logprobs
from worker.model.cache_arg import CACHE_ARG
from worker.multi.lora import SharedBase
from worker.trainer.scoring import collate_sequences, last_hidden


def collate_rows(ids: list[list[int]], masks: list[list[int]], owners: list[str | None], *, pad_id: int, device,
                 share_prefixes: bool = True):
    """The combined batch, each adapter's shared prompts held once, as the trainer alone holds them (scoring.py):
    a prompt two adapters' rows share is held once per adapter, since each prompt pass is its own adapter's.
    Without `share_prefixes` (a job with gradient checkpointing in it), every row whole."""
    return collate_sequences(ids, masks, pad_id=pad_id, device=device, share_prefixes=share_prefixes, owners=owners)


def routed_hidden(shared: SharedBase, batch, names: list[str | None], autocast) -> Tensor:
    """scoring.py's _hidden_states over the shared base, each pass routed: the prompt pass by the adapter of each
    distinct prompt, the rest by the adapter of each row."""
    model = shared.model
    if batch.position_ids_BT is not None:  # packed rows (worker/trainer/packing.py): attention by position restarts
        with shared.router.rows(names), autocast():
            return last_hidden(model, input_ids=batch.input_ids_BT, position_ids=batch.position_ids_BT,
                               use_cache=False)
    if batch.prefix_ids_GP is None:
        with shared.router.rows(names), autocast():
            return last_hidden(model, input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT,
                               use_cache=False)
    prefix_names: list[str | None] = [None] * batch.prefix_ids_GP.shape[0]
    for name, g in zip(names, batch.prefix_of_B.tolist()):
        prefix_names[g] = name
    cache = DynamicCache(config=model.config)
    prefix_mask_GP = batch.prefix_mask_GP
    with shared.router.rows(prefix_names), autocast():
        model(input_ids=batch.prefix_ids_GP, attention_mask=prefix_mask_GP,
              position_ids=(prefix_mask_GP.cumsum(-1) - 1).clamp(min=0), **{CACHE_ARG: cache}, use_cache=True,
              logits_to_keep=1)
    cache.batch_select_indices(batch.prefix_of_B)
    start_B1 = prefix_mask_GP.sum(-1)[batch.prefix_of_B][:, None]
    T = batch.input_ids_BT.shape[1]
    with shared.router.rows(names), autocast():
        return last_hidden(model, input_ids=batch.input_ids_BT,
                           attention_mask=torch.cat([prefix_mask_GP[batch.prefix_of_B], batch.attention_mask_BT], 1),
                           position_ids=start_B1 + torch.arange(T, device=start_B1.device), **{CACHE_ARG: cache},
                           use_cache=True)


def rows_logprobs(shared: SharedBase, hidden_BTH: Tensor, batch, rows: slice, *, temperature: float,
                  chunk_size: int | None, owner: str | None = None, sequences: slice | None = None,
                  head_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT) of the rows `rows` (all of adapter `owner`) of the combined batch at their action
    tokens (zero elsewhere), one row per sequence (scoring.py's layout): packed rows hold the `sequences` of the
    batch's sequence layout (default: `rows`, one sequence a row). `head_dtype`: as sequence_logprobs'."""
    action_BT = batch.action_mask_BT[rows].bool()
    logp_1N, entropy_1N = token_logprobs(routed_head(shared, owner), hidden_BTH[rows][action_BT][None],
                                         batch.targets_BT[rows][action_BT][None], temperature=temperature,
                                         chunk_size=chunk_size, head_dtype=head_dtype)
    layout_BT = batch.sequence_action_mask_BT[rows if sequences is None else sequences].bool()
    zeros_BT = logp_1N.new_zeros(layout_BT.shape)
    return zeros_BT.index_put((layout_BT,), logp_1N[0]), zeros_BT.index_put((layout_BT,), entropy_1N[0])


def routed_head(shared: SharedBase, owner: str | None):
    """The LM head; where an adapter has a LoRA on it (the engine's train_unembed), the head routed to `owner`
    for every token it is given (token_logprobs hands it chunks of tokens, not rows)."""
    head = shared.model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        return head  # the plain head: token_logprobs' fused path

    def routed(hidden_NH: Tensor) -> Tensor:
        with shared.router.rows([owner] * hidden_NH.shape[0]):
            return head(hidden_NH)
    return routed


def row_slices(counts: list[int]) -> list[slice]:
    """Consecutive slices of the combined batch, one per part of `counts` rows."""
    slices, start = [], 0
    for n in counts:
        slices.append(slice(start, start + n))
        start += n
    return slices
